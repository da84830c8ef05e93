"""Typed errors raised by the workers."""

from __future__ import annotations

from pagedserve.config import ConfigError


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


class GGUFError(ModelLoadError):
    """A ``.gguf`` file (or a folder meant to hold one) that cannot be read or converted."""


class UnsupportedGGUFError(UnsupportedModelError):
    """A GGUF file whose architecture or tensor encoding this engine cannot read.

    ``kind`` is ``"architecture"`` or ``"quantization type"``; ``found`` what the file holds,
    ``supported`` what can be read instead.
    """

    def __init__(self, source: str, kind: str, found: str, supported: list[str]) -> None:
        ModelLoadError.__init__(
            self,
            f"{source}: GGUF {kind} {found!r} is not supported; "
            f"supported GGUF {kind}s: {', '.join(supported)}",
        )
        self.source = source
        self.kind = kind
        self.found = found
        self.architecture = found if kind == "architecture" else ""
        self.supported = supported
        self.detail = str(self)

    def __reduce__(self) -> tuple[type, tuple[str, str, str, list[str]]]:  # type: ignore[override]
        return (type(self), (self.source, self.kind, self.found, self.supported))


class UnknownModelError(ModelLoadError, ConfigError):
    """A model name that is neither a checkpoint directory, a ``.gguf`` file (or a folder holding
    one), nor a built-in model. Also a ``ConfigError`` on the ``model`` field, so front ends that
    report bad options report it the same way."""

    def __init__(self, message: str) -> None:
        ConfigError.__init__(self, "model", message)

    def __reduce__(self) -> tuple[type, tuple[str]]:  # type: ignore[override]
        return (type(self), (self.message,))
