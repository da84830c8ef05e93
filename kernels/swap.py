"""swap_blocks: copy whole KV blocks between two pools (device and host tier) in every layer.

Both pools have the per-layer shape ``[num_blocks, 2, B, H_kv, D]`` but their own block ids and
possibly their own devices. One gather and one indexed scatter per layer, batched over every
pair of the step; the host tier is outside a Triton kernel's reach, so this is torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.errors import KernelArgumentError

__all__ = ["swap_blocks"]


def swap_blocks(
    src_caches: Sequence[torch.Tensor],  # per layer [num_src_blocks, 2, B, H_kv, D]
    dst_caches: Sequence[torch.Tensor],  # per layer [num_dst_blocks, 2, B, H_kv, D]
    pairs: torch.Tensor,  # [n, 2] int64 on the CPU: (src block id, dst block id)
) -> None:
    """``dst_caches[l][d] = src_caches[l][s]`` for every pair and layer.

    Destinations must be distinct (an indexed scatter with repeated indices keeps an arbitrary
    one). A copy from the device to pinned host memory is synchronous for the host; a copy to
    the device is ordered on the current stream.
    """
    if len(src_caches) != len(dst_caches) or not src_caches:
        raise KernelArgumentError("swap_blocks needs one source and one destination per layer")
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        raise KernelArgumentError(f"pairs must be [n, 2] int64, got {tuple(pairs.shape)}")
    if pairs.shape[0] == 0:
        return
    pairs = pairs.cpu()
    src_ids, dst_ids = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for i, (s, d) in enumerate(zip(src_caches, dst_caches, strict=True)):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise KernelArgumentError(
                f"layer {i}: source {tuple(s.shape)} {s.dtype} and destination "
                f"{tuple(d.shape)} {d.dtype} blocks differ"
            )
    if int(src_ids.min()) < 0 or int(src_ids.max()) >= src_caches[0].shape[0]:
        raise KernelArgumentError(f"source block ids outside [0, {src_caches[0].shape[0]})")
    if int(dst_ids.min()) < 0 or int(dst_ids.max()) >= dst_caches[0].shape[0]:
        raise KernelArgumentError(f"destination block ids outside [0, {dst_caches[0].shape[0]})")
    if len(set(dst_ids.tolist())) != len(dst_ids):
        raise KernelArgumentError("swap_blocks destinations must be distinct")
    s_idx = src_ids.to(src_caches[0].device, non_blocking=True)
    d_idx = dst_ids.to(dst_caches[0].device, non_blocking=True)
    for s, d in zip(src_caches, dst_caches, strict=True):
        if s.element_size() == 1:  # an fp8 KV cache: CPU index_copy_ has no fp8 kernel
            s, d = s.view(torch.uint8), d.view(torch.uint8)
        rows = s.index_select(0, s_idx)  # [n, 2, B, H_kv, D] on the source's device
        # A device -> host copy must land before the host-side scatter reads it: blocking.
        d.index_copy_(0, d_idx, rows.to(d.device, non_blocking=d.device.type != "cpu"))
