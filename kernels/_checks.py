"""Argument checks shared by the Triton launchers and the torch references.

Every check raises :class:`KernelArgumentError` (or :class:`KernelDtypeError`) with a message that
names the argument, what was expected and what was passed. Checks never synchronise with the
device: they read shapes, strides, dtypes and devices only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.cp_layout import CPLayout
from pagedserve.kernels.errors import KernelArgumentError, KernelDtypeError
from pagedserve.kernels.kv_quant import FP8_E4M3, KV_STORAGE_DTYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may hold: the activations' dtype, or a narrower storage dtype (kv_quant).
KV_CACHE_DTYPES = (*FLOAT_DTYPES, FP8_E4M3)
TRITON_KV_CACHE_DTYPES = (*TRITON_FLOAT_DTYPES, FP8_E4M3)


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise KernelDtypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise KernelArgumentError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelDtypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise KernelArgumentError(f"all tensors must be on one device, got {devices}")


def _inner_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must have unit stride in its last dim, got {x.stride()}")


def check_kv_cache(kv_cache: torch.Tensor, allowed: Sequence[torch.dtype]) -> tuple[int, ...]:
    """Returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    _tensor("kv_cache", kv_cache)
    _ndim("kv_cache", kv_cache, 5, "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
    if kv_cache.shape[1] != 2:
        raise KernelArgumentError(f"kv_cache dim 1 must be 2 (K, V), got {tuple(kv_cache.shape)}")
    _dtype("kv_cache", kv_cache, allowed)
    if not kv_cache.is_contiguous():
        raise KernelArgumentError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    nb, _, bs, hkv, d = kv_cache.shape
    return nb, bs, hkv, d


def kv_dtype_pairs(act: torch.dtype, kv_cache: torch.Tensor) -> bool:
    """Activations of dtype ``act`` may be written to / read from this cache."""
    return act == kv_cache.dtype or kv_cache.dtype in KV_STORAGE_DTYPES


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, (float, int)) or not 0.0 < s < float("inf"):
            raise KernelArgumentError(f"{name} must be a positive finite float, got {s!r}")


def check_triton_head_dim(head_dim: int) -> None:
    """The Triton kernels tile the head dim with tl.arange, which needs a power of two."""
    if head_dim < 16 or head_dim > 512 or head_dim & (head_dim - 1):
        raise KernelArgumentError(
            f"the Triton kernels support head_dim in powers of two 16..512, got {head_dim}; "
            "use the torch reference or pad the head dim"
        )


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    allowed: Sequence[torch.dtype] = KV_CACHE_DTYPES,
) -> None:
    _tensor("key", key)
    _tensor("value", value)
    _tensor("slot_mapping", slot_mapping)
    _, _, hkv, d = check_kv_cache(kv_cache, allowed)
    _ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise KernelArgumentError(
            f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}"
        )
    if tuple(key.shape[1:]) != (hkv, d):
        raise KernelArgumentError(
            f"key is [T, {key.shape[1]}, {key.shape[2]}] but the cache holds [.., {hkv}, {d}]"
        )
    for name, x in (("key", key), ("value", value)):
        _dtype(name, x, FLOAT_DTYPES)
        if not kv_dtype_pairs(x.dtype, kv_cache):
            raise KernelDtypeError(
                f"{name} dtype {x.dtype} must equal kv_cache dtype {kv_cache.dtype} (or the "
                "cache be a KV storage dtype: bfloat16, float8_e4m3fn)"
            )
        _inner_contiguous(name, x)
    _ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != key.shape[0]:
        raise KernelArgumentError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    _same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def check_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None,
    cp: CPLayout,
    allowed: Sequence[torch.dtype] = KV_CACHE_DTYPES,
) -> tuple[int, ...]:
    """Returns (num_blocks, block_size, num_kv_heads, head_dim, num_q_heads, num_seqs)."""
    for name, x in (("q", q), ("out", out), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens), ("block_table", block_table)):
        _tensor(name, x)
    nb, bs, hkv, d = check_kv_cache(kv_cache, allowed)
    _ndim("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    _dtype("q", q, FLOAT_DTYPES)
    if q.dtype != out.dtype or not kv_dtype_pairs(q.dtype, kv_cache):
        raise KernelDtypeError(
            f"q ({q.dtype}), out ({out.dtype}) and kv_cache ({kv_cache.dtype}) must share a dtype"
            " (a bfloat16 or float8_e4m3fn cache may serve any)"
        )
    hq = q.shape[1]
    if q.shape[2] != d:
        raise KernelArgumentError(f"q head_dim {q.shape[2]} != kv_cache head_dim {d}")
    if hq % hkv != 0:
        raise KernelArgumentError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if out.shape != q.shape:
        raise KernelArgumentError(
            f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}"
        )
    _inner_contiguous("q", q)
    _inner_contiguous("out", out)
    _ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    _ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    _ndim("block_table", block_table, 2, "[num_seqs, max_blocks]")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        _dtype(name, x, (torch.int32,))
    ns = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != ns + 1:
        raise KernelArgumentError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected num_seqs + 1 = {ns + 1}"
        )
    if block_table.shape[0] < ns:
        raise KernelArgumentError(f"block_table has {block_table.shape[0]} rows for {ns} sequences")
    if not cu_seqlens_q.is_contiguous() or not seq_lens.is_contiguous():
        raise KernelArgumentError("cu_seqlens_q and seq_lens must be contiguous")
    _inner_contiguous("block_table", block_table)
    _same_device(q=q, kv_cache=kv_cache, out=out, cu_seqlens_q=cu_seqlens_q,
                 seq_lens=seq_lens, block_table=block_table)
    if not isinstance(softmax_scale, (float, int)) or isinstance(softmax_scale, bool):
        raise KernelDtypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise KernelArgumentError(
            f"sliding_window must be None or an int >= 1, got {sliding_window}"
        )
    if bs % cp.interleave != 0:
        raise KernelArgumentError(
            f"cp_interleave ({cp.interleave}) must divide block_size ({bs})"
        )
    return nb, bs, hkv, d, hq, ns


def check_merge(outputs: torch.Tensor, lses: torch.Tensor,
                allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    _tensor("outputs", outputs)
    _tensor("lses", lses)
    _ndim("outputs", outputs, 4, "[num_shards, num_tokens, num_heads, head_dim]")
    _ndim("lses", lses, 3, "[num_shards, num_tokens, num_heads]")
    if tuple(lses.shape) != tuple(outputs.shape[:3]):
        raise KernelArgumentError(
            f"lses shape {tuple(lses.shape)} must equal "
            f"outputs.shape[:3] {tuple(outputs.shape[:3])}"
        )
    if outputs.shape[0] < 1:
        raise KernelArgumentError("need at least one shard to merge")
    _dtype("outputs", outputs, allowed)
    _dtype("lses", lses, (torch.float32, torch.float64))
    _same_device(outputs=outputs, lses=lses)


def check_copy_blocks(
    kv_caches: Sequence[torch.Tensor], src_to_dst: torch.Tensor | Sequence[Sequence[int]]
) -> torch.Tensor:
    """Returns ``src_to_dst`` as an int64 ``[n, 2]`` tensor on the caches' device."""
    if isinstance(kv_caches, torch.Tensor) or len(kv_caches) == 0:
        raise KernelArgumentError("kv_caches must be a non-empty list of per-layer caches")
    device = kv_caches[0].device
    for i, c in enumerate(kv_caches):
        _tensor(f"kv_caches[{i}]", c)
        if c.dim() < 2 or not c.is_contiguous():
            raise KernelArgumentError(
                f"kv_caches[{i}] must be a contiguous [num_blocks, ...] tensor"
            )
        if c.device != device:
            raise KernelArgumentError(f"kv_caches[{i}] is on {c.device}, kv_caches[0] on {device}")
    if isinstance(src_to_dst, torch.Tensor):
        pairs = src_to_dst
        _dtype("src_to_dst", pairs, (torch.int32, torch.int64))
        pairs = pairs.to(device=device, dtype=torch.int64)
    else:
        pairs = torch.tensor([list(p) for p in src_to_dst], dtype=torch.int64).reshape(-1, 2)
        pairs = pairs.to(device)
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise KernelArgumentError(f"src_to_dst must be [n, 2], got {tuple(pairs.shape)}")
    if pairs.device.type == "cpu" and pairs.numel():
        nb = min(c.shape[0] for c in kv_caches)
        if int(pairs.min()) < 0 or int(pairs.max()) >= nb:
            raise KernelArgumentError(f"src_to_dst has block ids outside [0, {nb})")
    return pairs.contiguous()
