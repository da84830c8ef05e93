"""A host buffer (numpy view, pinned on CUDA) mirrored by a device tensor."""

from __future__ import annotations

import numpy as np
import torch


class HostDeviceBuffer:
    """``np`` is a numpy view of the host tensor; ``commit(n)`` copies the first n rows over."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.host.numpy()
        # On CPU the "device" tensor is the host tensor itself: no copy at all.
        self.device = (
            self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        )

    def commit(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device (non-blocking from pinned memory)."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]
