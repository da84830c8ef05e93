"""The physical KV pool: the only place the KV-cache tensors are allocated.

Layout (``KVCacheLayout``): block ids come from one pool of ``num_blocks`` shared by all
KV-cache groups, and every group has the same number of layers. So the pool allocates
``len(groups[0])`` tensors of ``[num_blocks, 2, block_size, H_kv, D]`` and layer ``groups[g][j]``
uses tensor ``j``: two layers of different groups share a tensor but never a block id.
"""

from __future__ import annotations

import torch

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
    ) -> None:
        groups = layout.groups
        if not groups or any(len(g) != len(groups[0]) for g in groups):
            raise ValueError(f"every KV group needs the same number of layers, got {groups}")
        covered = sorted(i for g in groups for i in g)
        if covered != list(range(len(layers))):
            raise ValueError(f"KV groups {groups} do not cover layers 0..{len(layers) - 1}")
        self.layout = layout
        self.tensors: list[torch.Tensor] = []
        for j in range(len(groups[0])):
            shapes = {(layers[g[j]].num_kv_heads, layers[g[j]].head_dim) for g in groups}
            if len(shapes) != 1:
                raise ValueError(f"layers sharing KV tensor {j} differ in shape: {shapes}")
            ((hkv, d),) = shapes
            shape = (layout.num_blocks, 2, layout.block_size, hkv, d)
            # zeros, not empty: the null block and unwritten slots must never hold NaN.
            self.tensors.append(torch.zeros(shape, dtype=dtype, device=device))
        for g, group in enumerate(groups):
            for j, layer_index in enumerate(group):
                layers[layer_index].kv_cache = self.tensors[j]
                layers[layer_index].kv_group = g

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
