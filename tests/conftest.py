"""Shared pytest configuration: registers the multi-rank pool plugin (tests/rankpool)."""

pytest_plugins = ["rankpool.plugin"]
