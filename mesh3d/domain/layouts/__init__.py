"""Blocks, token grids and the moves between layouts."""
