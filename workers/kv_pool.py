"""The physical KV pool: the only place the KV-cache tensors are allocated.

Layout (``KVCacheLayout``): block ids come from one pool of ``num_blocks`` shared by all
KV-cache groups, and every group has the same number of layers. So the pool allocates
``len(groups[0])`` tensors of ``[num_blocks, 2, block_size, H_kv, D]`` and layer ``groups[g][j]``
uses tensor ``j``: two layers of different groups share a tensor but never a block id.

With ``layout.num_host_blocks`` the pool also holds the host tier: the same tensors with their
own block ids in host memory (pinned on GPU machines, so copies run asynchronously to the
host's view; plain memory on CPU-only ones). Tier copies run on a stream of their own and the
forward pass waits for them.

``dtype`` is the KV cache's own (``workers.kv_dtype``): the layers quantize to it on write and
widen from it on read with their per-layer ``k_scale`` / ``v_scale`` (1.0 until calibrated).

A draft model's attention layers (speculative decoding) get a tensor each, of their own shape
but the same ``num_blocks`` and block size, and read the block table of the target group
``layout.draft_groups`` names: the target's block ids index their KV too, so allocation, trims,
copy-on-write and tier copies (which run over ``tensors``) carry it along.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels import needs_scale, swap_blocks
from pagedserve.messages import KVCacheLayout, LayerKVSpec
from pagedserve.workers.layers.attention import PagedAttention


def page_bytes(spec: LayerKVSpec, block_size: int) -> int:
    """Bytes of one block of one layer: K and V for ``block_size`` tokens."""
    return 2 * block_size * spec.num_kv_heads * spec.head_size * spec.dtype_bytes


class KVPool:
    def __init__(
        self,
        layout: KVCacheLayout,
        layers: list[PagedAttention],
        dtype: torch.dtype,
        device: torch.device,
        draft_layers: Sequence[PagedAttention] = (),
    ) -> None:
        groups = layout.groups
        if not groups or any(len(g) != len(groups[0]) for g in groups):
            raise ValueError(f"every KV group needs the same number of layers, got {groups}")
        covered = sorted(i for g in groups for i in g)
        if covered != list(range(len(layers))):
            raise ValueError(f"KV groups {groups} do not cover layers 0..{len(layers) - 1}")
        if len(draft_layers) != len(layout.draft_groups):
            raise ValueError(f"{len(draft_layers)} draft layers for draft groups "
                             f"{layout.draft_groups}")
        self.layout = layout
        self.dtype = dtype
        self.layers = layers
        self.draft_layers = list(draft_layers)
        self.tensors: list[torch.Tensor] = []
        self.host_tensors: list[torch.Tensor] = []
        for j in range(len(groups[0])):
            shapes = {(layers[g[j]].num_kv_heads, layers[g[j]].head_dim) for g in groups}
            if len(shapes) != 1:
                raise ValueError(f"layers sharing KV tensor {j} differ in shape: {shapes}")
            ((hkv, d),) = shapes
            self._allocate(hkv, d, device)
        for g, group in enumerate(groups):
            for j, layer_index in enumerate(group):
                layers[layer_index].kv_cache = self.tensors[j]
                layers[layer_index].kv_group = g
        for layer, g in zip(self.draft_layers, layout.draft_groups, strict=True):
            layer.kv_cache = self._allocate(layer.num_kv_heads, layer.head_dim, device)
            layer.kv_group = g
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # A fresh pool holds nothing written with earlier scales.
        for layer in (*layers, *self.draft_layers):
            layer.k_scale = layer.v_scale = 1.0
            layer.calibrate_kv_scales = False

    def _allocate(self, num_kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """One more device tensor ``[num_blocks, 2, B, H_kv, D]`` (and its host-tier twin)."""
        layout = self.layout
        shape = (layout.num_blocks, 2, layout.block_size, num_kv_heads, head_dim)
        # zeros, not empty: the null block and unwritten slots must never hold NaN. Not in
        # 2 MiB pages: see workers/huge_pages.py for what they cost a pool at start.
        self.tensors.append(torch.zeros(shape, dtype=self.dtype, device=device))
        if layout.num_host_blocks:
            host_shape = (layout.num_host_blocks, *shape[1:])
            pin = device.type == "cuda"
            self.host_tensors.append(torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin))
        return self.tensors[-1]

    def calibrate_kv_scales(self) -> bool:
        """Arm every layer to take its fp8 scales from the next tokens it writes (the first
        real prefill); False (nothing armed) for an unscaled cache dtype."""
        if not needs_scale(self.dtype):
            return False
        for layer in (*self.layers, *self.draft_layers):
            layer.calibrate_kv_scales = True
        return True

    def kv_scales(self) -> list[tuple[float, float]]:
        """Per layer ``(k_scale, v_scale)``."""
        return [(layer.k_scale, layer.v_scale) for layer in self.layers]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def num_host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_tensors)

    def copy_tiers(
        self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]
    ) -> None:
        """Run a step's tier copies: every ``(device, host)`` pair, then every ``(host,
        device)`` pair, so a device block re-used this step is read before it is overwritten."""
        if not to_host and not to_device:
            return
        if not self.host_tensors:
            raise RuntimeError("tier copies sent to a worker without a host KV tier")
        stream = self._copy_stream
        if stream is None:
            self._copy(to_host, to_device)
            return
        # The copies read blocks the previous forward pass wrote, and the next forward pass
        # reads what they wrote: order them after the one and before the other.
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._copy(to_host, to_device)
        compute.wait_stream(stream)

    def _copy(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> None:
        if to_host:
            swap_blocks(self.tensors, self.host_tensors, _pairs(to_host))
        if to_device:
            swap_blocks(self.host_tensors, self.tensors, _pairs(to_device))


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([list(p) for p in pairs], dtype=torch.int64).reshape(-1, 2)
