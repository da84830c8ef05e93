"""Process groups, tensor-parallel layers and collectives (imports only config and torch)."""

from pagedserve.parallel.state import ParallelState, divide

__all__ = ["ParallelState", "divide"]
