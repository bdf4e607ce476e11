"""Attention on sharded sequences and token grids: modes, ring, block kernels, tiles, workspace, the compiled op."""
