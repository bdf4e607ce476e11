"""Graphs and unstructured meshes: node partitions, partitioners, the graphs' halos, and meshes to try them on.

Usage::

    from mesh3d import graphs
    part = graphs.sfc_partition(coords, parts=4)                 # Hilbert order over xyz (or 2-D) coordinates
    part = graphs.metis_partition(edge_index, num_nodes, parts=4)  # pymetis when installed, else a graph fallback
    g = graphs.Graph(edge_index, part)                           # edges owned by their destination's part
    g.halo_counts(part)                                          # nodes each part receives: from the partition alone
    mesh = graphs.icosahedral_mesh(refinements=2)                # nodes on the sphere, edges both ways

Nothing here needs a process group (the domain layout on top: ``mesh3d.domain.graph``; docs/domain.md, "Graphs and
meshes").
"""

from mesh3d.graphs.graph import Graph, HaloPlan
from mesh3d.graphs.meshes import (
    TriMesh, channel_mesh, grid_to_mesh_edges, icosahedral_mesh, lat_lon_to_xyz, mesh_to_grid_edges)
from mesh3d.graphs.partition import (
    Partition, grid_block_partition, latlon_block_partition, metis_available, metis_partition, sfc_partition)

__all__ = ["Graph", "HaloPlan", "Partition", "TriMesh", "channel_mesh", "grid_block_partition", "grid_to_mesh_edges",
           "icosahedral_mesh", "lat_lon_to_xyz", "latlon_block_partition", "mesh_to_grid_edges", "metis_available",
           "metis_partition", "sfc_partition"]
