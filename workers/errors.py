"""Typed errors raised by the workers."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A checkpoint directory that is missing, unreadable or inconsistent."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture (or an option of it) this engine does not implement."""

    def __init__(self, architecture: str, supported: list[str], detail: str = "") -> None:
        what = detail or f"architecture {architecture!r} is not supported"
        super().__init__(f"{what}; supported architectures: {', '.join(supported)}")
        self.architecture = architecture
        self.supported = supported
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, list[str], str]]:
        # Crosses process boundaries (Ray) intact, with its own constructor's arguments.
        return (type(self), (self.architecture, self.supported, self.detail))
