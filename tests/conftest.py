"""Shared pytest fixtures. Tests never reach the network: only 127.0.0.1."""
