"""Rows moved between domain ranks point to point, differentiable, every peer checked."""
