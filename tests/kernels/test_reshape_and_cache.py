"""reshape_and_cache: Triton (interpreter on CPU) and torch reference against a plain loop."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    KernelArgumentError,
    KernelDtypeError,
    reshape_and_cache,
    reshape_and_cache_ref,
    triton_reshape_and_cache,
)

IMPLS = {"ref": reshape_and_cache_ref, "triton": triton_reshape_and_cache}


def _case(block_size: int, h_kv: int, d: int, slot_dtype: torch.dtype, seed: int,
          dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    num_blocks, t = 5, 13
    cache = torch.randn(num_blocks, 2, block_size, h_kv, d, generator=g).to(dtype)
    # Keys/values as strided views of a fused qkv buffer (what a model produces).
    qkv = torch.randn(t, 3 * h_kv, d, generator=g).to(dtype)
    key, value = qkv[:, h_kv : 2 * h_kv], qkv[:, 2 * h_kv :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[torch.tensor([0, 4, 5, 12])] = -1  # padding / tokens another CP rank stores
    return cache, key, value, slots.to(slot_dtype)


def _expected(cache, key, value, slots):
    want = cache.clone()
    b = cache.shape[2]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // b, 0, s % b] = key[i]
            want[s // b, 1, s % b] = value[i]
    return want


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("block_size,h_kv,d,slot_dtype,dtype", [
    (8, 2, 64, torch.int64, torch.float32),
    (16, 1, 128, torch.int32, torch.float32),
    (32, 4, 72, torch.int64, torch.float32),  # any head dim: the copy is flat
    (16, 2, 64, torch.int64, torch.float16),
])
def test_reshape_and_cache(impl, block_size, h_kv, d, slot_dtype, dtype) -> None:
    cache, key, value, slots = _case(block_size, h_kv, d, slot_dtype, seed=block_size + d)
    want = _expected(cache, key, value, slots)
    IMPLS[impl](key, value, cache, slots)
    # Exact: a copy, and slots of -1 leave every other element of the cache untouched.
    assert torch.equal(cache, want)


def test_dispatcher_uses_reference_on_cpu() -> None:
    cache, key, value, slots = _case(8, 2, 64, torch.int64, seed=3)
    want = _expected(cache, key, value, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_rejects_bad_arguments(impl) -> None:
    cache, key, value, slots = _case(8, 2, 64, torch.int64, seed=4)
    fn = IMPLS[impl]
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        fn(key, value, cache, slots[:-1])
    with pytest.raises(KernelDtypeError, match="slot_mapping"):
        fn(key, value, cache, slots.float())
    with pytest.raises(KernelDtypeError, match="kv_cache dtype"):
        fn(key.double(), value.double(), cache, slots)
    with pytest.raises(KernelArgumentError, match="contiguous"):
        fn(key, value, cache.transpose(2, 3), slots)
    with pytest.raises(KernelArgumentError, match="cache holds"):
        fn(key[:, :1], value[:, :1], cache, slots)
    with pytest.raises(KernelArgumentError, match="unit stride"):
        fn(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, slots)
