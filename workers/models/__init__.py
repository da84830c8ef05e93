"""Model implementations and the architecture registry."""

from pagedserve.workers.models.registry import model_class, supported_architectures

__all__ = ["model_class", "supported_architectures"]
