"""Shared fixtures. Subdirectories (transport/, rdma/, ...) add their own conftest."""
