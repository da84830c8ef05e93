"""Helpers shared by the test folders; ``tests/`` is on pytest's pythonpath."""
