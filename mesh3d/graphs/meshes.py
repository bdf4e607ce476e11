"""Meshes to run graph models on: an icosahedral mesh of the sphere, a triangulated 2-D channel around a cylinder, and
the grid-to-mesh / mesh-to-grid edges of a GraphCast-style encoder and decoder. numpy only.

Usage::

    mesh = icosahedral_mesh(refinements=3)            # 642 nodes on the unit sphere; mesh.edges: both directions
    lat, lon = mesh.lat_lon()
    g2m = grid_to_mesh_edges(grid_lat, grid_lon, mesh, radius=0.6 * mesh.longest_edge())   # (2, E): grid id -> mesh id
    m2g = mesh_to_grid_edges(grid_lat, grid_lon, mesh, k=3)                                  # (2, E): mesh id -> grid id
    cfd = channel_mesh(nx=40, ny=12)                  # 2-D points, triangles, node types (fluid, wall, inflow, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NODE_TYPES", "TriMesh", "channel_mesh", "grid_to_mesh_edges", "icosahedral_mesh", "lat_lon_to_xyz",
           "mesh_to_grid_edges"]

#: The node types of ``channel_mesh`` (its ``node_type`` values index this tuple).
NODE_TYPES = ("fluid", "wall", "inflow", "outflow", "obstacle")


@dataclass(frozen=True)
class TriMesh:
    """Points ``(N, d)`` and triangles ``(T, 3)``; ``node_type`` per node (``NODE_TYPES``) where the mesh has them.

    Usage: ``mesh.edges`` (every triangle side both ways, ``(2, E)``), ``mesh.lat_lon()`` on the sphere
    """

    points: np.ndarray
    faces: np.ndarray
    node_type: np.ndarray | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.points.shape[0])

    @property
    def edges(self) -> np.ndarray:
        """Every side of every triangle, in both directions, once: ``(2, E)`` int64 sorted by (source, destination)."""
        f = self.faces
        a = np.concatenate([f[:, 0], f[:, 1], f[:, 2], f[:, 1], f[:, 2], f[:, 0]])
        b = np.concatenate([f[:, 1], f[:, 2], f[:, 0], f[:, 0], f[:, 1], f[:, 2]])
        pairs = np.unique(a.astype(np.int64) * self.num_nodes + b)
        return np.stack([pairs // self.num_nodes, pairs % self.num_nodes])

    def longest_edge(self) -> float:
        e = self.edges
        return float(np.linalg.norm(self.points[e[0]] - self.points[e[1]], axis=1).max()) if e.size else 0.0

    def lat_lon(self) -> tuple[np.ndarray, np.ndarray]:
        """Latitude and longitude (degrees, longitude in [0, 360)) of points on the unit sphere."""
        x, y, z = self.points.T
        return np.degrees(np.arcsin(np.clip(z, -1, 1))), np.degrees(np.arctan2(y, x)) % 360.0


def lat_lon_to_xyz(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Points on the unit sphere ``(N, 3)`` from latitude and longitude in degrees.

    Usage: ``sfc_partition(lat_lon_to_xyz(lat, lon), parts=4)``
    """
    lat, lon = np.radians(np.asarray(lat, dtype=np.float64)), np.radians(np.asarray(lon, dtype=np.float64))
    return np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=-1)


def icosahedral_mesh(refinements: int = 2) -> TriMesh:
    """An icosahedron refined ``refinements`` times (each triangle into four, new points pushed onto the sphere).

    Usage: ``icosahedral_mesh(6).num_nodes == 40962`` (GraphCast's finest mesh); 2: 162 nodes, 3: 642
    """
    if refinements < 0:
        raise ValueError(f"icosahedral_mesh: refinements={refinements} must be >= 0")
    t = (1 + 5 ** 0.5) / 2
    points = np.array([[-1, t, 0], [1, t, 0], [-1, -t, 0], [1, -t, 0], [0, -1, t], [0, 1, t], [0, -1, -t],
                       [0, 1, -t], [t, 0, -1], [t, 0, 1], [-t, 0, -1], [-t, 0, 1]], dtype=np.float64)
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    faces = np.array([[0, 11, 5], [0, 5, 1], [0, 1, 7], [0, 7, 10], [0, 10, 11], [1, 5, 9], [5, 11, 4], [11, 10, 2],
                      [10, 7, 6], [7, 1, 8], [3, 9, 4], [3, 4, 2], [3, 2, 6], [3, 6, 8], [3, 8, 9], [4, 9, 5],
                      [2, 4, 11], [6, 2, 10], [8, 6, 7], [9, 8, 1]], dtype=np.int64)
    for _ in range(refinements):
        n = len(points)
        sides = np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
        key = np.sort(sides, axis=1)
        unique, inverse = np.unique(key[:, 0] * n + key[:, 1], return_inverse=True)
        a, b = unique // n, unique % n
        middle = points[a] + points[b]
        points = np.concatenate([points, middle / np.linalg.norm(middle, axis=1, keepdims=True)])
        m = (n + inverse).reshape(3, -1).T  # the midpoints of sides (0-1, 1-2, 2-0) of each face
        faces = np.concatenate([np.stack([faces[:, 0], m[:, 0], m[:, 2]], 1), np.stack([faces[:, 1], m[:, 1], m[:, 0]], 1),
                                np.stack([faces[:, 2], m[:, 2], m[:, 1]], 1), m])
    return TriMesh(points, faces)


def _grid_xyz(grid_lat: np.ndarray, grid_lon: np.ndarray) -> np.ndarray:
    lat, lon = np.meshgrid(np.asarray(grid_lat, dtype=np.float64), np.asarray(grid_lon, dtype=np.float64), indexing="ij")
    return lat_lon_to_xyz(lat.ravel(), lon.ravel())


def _chunks(n: int, size: int = 4096):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def grid_to_mesh_edges(grid_lat: np.ndarray, grid_lon: np.ndarray, mesh: TriMesh, radius: float) -> np.ndarray:
    """Edges from every grid point (row-major id over lat x lon) to the mesh nodes within ``radius`` of it (chord
    length on the unit sphere), and to its nearest mesh node where none is that close: ``(2, E)``, sources on the grid.

    Usage: ``grid_to_mesh_edges(lat, lon, mesh, 0.6 * mesh.longest_edge())`` (GraphCast's encoder)
    """
    grid = _grid_xyz(grid_lat, grid_lon)
    src, dst = [], []
    for lo, hi in _chunks(len(grid)):
        d = np.linalg.norm(grid[lo:hi, None, :] - mesh.points[None], axis=-1)
        near = d <= radius
        near[np.arange(hi - lo), d.argmin(1)] = True
        g, m = np.nonzero(near)
        src.append(g + lo)
        dst.append(m)
    return np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)


def mesh_to_grid_edges(grid_lat: np.ndarray, grid_lon: np.ndarray, mesh: TriMesh, k: int = 3) -> np.ndarray:
    """Edges to every grid point from its ``k`` nearest mesh nodes: ``(2, E)``, sources on the mesh.

    Usage: ``mesh_to_grid_edges(lat, lon, mesh)`` (GraphCast's decoder reads the 3 nodes of the triangle around a
    point; the 3 nearest nodes are that triangle's on a regular mesh)
    """
    grid = _grid_xyz(grid_lat, grid_lon)
    src, dst = [], []
    for lo, hi in _chunks(len(grid)):
        d = np.linalg.norm(grid[lo:hi, None, :] - mesh.points[None], axis=-1)
        nearest = np.argpartition(d, min(k, d.shape[1]) - 1, axis=1)[:, :k]
        src.append(np.sort(nearest, axis=1).ravel())
        dst.append(np.repeat(np.arange(lo, hi), nearest.shape[1]))
    return np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)


def channel_mesh(nx: int = 40, ny: int = 12, length: float = 4.0, height: float = 1.2, center: tuple = (1.0, 0.6),
                 radius: float = 0.2, jitter: float = 0.25, seed: int = 0) -> TriMesh:
    """A triangulated 2-D channel ``[0, length] x [0, height]`` around a cylinder (MeshGraphNet's ``cylinder_flow``):
    a jittered grid of ``nx`` x ``ny`` points split into triangles, those touching the cylinder removed.

    Usage: ``mesh = channel_mesh(); mesh.points (N, 2), mesh.faces, mesh.node_type (NODE_TYPES)``
    """
    if nx < 2 or ny < 2:
        raise ValueError(f"channel_mesh: nx={nx}, ny={ny} must both be >= 2")
    rng = np.random.default_rng(seed)
    xs, ys = np.linspace(0, length, nx), np.linspace(0, height, ny)
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    dx, dy = xs[1] - xs[0], ys[1] - ys[0]
    inner = (gx > 0) & (gx < length) & (gy > 0) & (gy < height)
    gx = gx + inner * rng.uniform(-jitter, jitter, gx.shape) * dx
    gy = gy + inner * rng.uniform(-jitter, jitter, gy.shape) * dy
    points = np.stack([gx.ravel(), gy.ravel()], 1)
    ids = np.arange(nx * ny).reshape(nx, ny)
    a, b, c, d = ids[:-1, :-1].ravel(), ids[1:, :-1].ravel(), ids[1:, 1:].ravel(), ids[:-1, 1:].ravel()
    flip = ((np.arange(nx - 1)[:, None] + np.arange(ny - 1)[None]) % 2).ravel().astype(bool)
    faces = np.concatenate([np.stack([a, b, np.where(flip, d, c)], 1), np.stack([np.where(flip, b, a), c, d], 1)])
    inside = np.linalg.norm(points - np.asarray(center), axis=1) < radius
    faces = faces[~inside[faces].any(1)]
    used = np.unique(faces)
    renumber = np.full(len(points), -1, dtype=np.int64)
    renumber[used] = np.arange(len(used))
    points, faces = points[used], renumber[faces]
    kind = np.zeros(len(points), dtype=np.int64)
    near = np.linalg.norm(points - np.asarray(center), axis=1) < radius + 1.5 * max(dx, dy)
    kind[near] = NODE_TYPES.index("obstacle")
    kind[(points[:, 1] <= 0) | (points[:, 1] >= height)] = NODE_TYPES.index("wall")
    kind[points[:, 0] <= 0] = NODE_TYPES.index("inflow")
    kind[points[:, 0] >= length] = NODE_TYPES.index("outflow")
    return TriMesh(points, faces, kind)
