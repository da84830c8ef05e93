"""Errors raised by the kernel launchers and references when their arguments do not fit."""

from __future__ import annotations


class KernelArgumentError(ValueError):
    """A tensor argument has the wrong shape, stride, device or value range."""


class KernelDtypeError(KernelArgumentError, TypeError):
    """A tensor argument has the wrong dtype (catchable as ValueError or TypeError)."""
