"""paged_attention: the torch reference against float64 dense attention, and the Triton kernel
(interpreter on CPU) against both, including decode context parallelism with an LSE merge.

Tolerances (max abs error / max abs of the float64 result): float32 1e-5, float16 5e-3,
bfloat16 2e-2 (the LSE, always float32, to at least 1e-5). The GPU run
(benchmarks/scripts/kernels_gpu.py) holds bf16 to 2e-2 and fp16 to 5e-3 against the float32
reference computed from the same rounded inputs; bf16 Triton parity runs only there, because the
interpreter's tl.dot mishandles bf16 operands.

Every batch mixes a fresh prefill, a chunked-prefill continuation over cached context and decodes
of very different lengths (one an exact multiple of the block size), with physical block ids
scattered and out of order and unused table entries pointing outside the cache. The reference
runs the wide matrix; the interpreter runs a covering subset.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import (
    CPLayout,
    KernelArgumentError,
    KernelDtypeError,
    merge_attn_states,
    paged_attention,
    paged_attention_ref,
    plan_paged_attention,
    reshape_and_cache_ref,
    triton_merge_attn_states,
    triton_paged_attention,
)


def _run(fn, b, cache=None, **kw):
    out = torch.full_like(b.q, math.nan)  # poisoned: an unwritten element fails the check
    lse = fn(b.q, b.caches[0] if cache is None else cache, out, b.cu_seqlens_q, b.seq_lens,
             b.block_table, b.scale, return_lse=True, **kw)
    return out, lse


def _assert_close(kh, got, want, dtype=torch.float32) -> None:
    out, lse = got
    want_out, want_lse = want
    assert kh.rel_err(out, want_out) <= kh.TOL[dtype]
    # The LSE is always returned in float32.
    assert kh.rel_err(lse, want_lse) <= max(kh.TOL[dtype], kh.TOL[torch.float32])


# (block size, q heads per kv head, kv heads, head dim, sliding window): every block size meets
# every GQA ratio once; windows smaller than and larger than a block.
REF_CASES = [
    (8, 1, 2, 64, None), (8, 4, 2, 128, 5), (8, 8, 1, 64, 40),
    (16, 1, 2, 128, 40), (16, 4, 1, 64, None), (16, 8, 2, 128, 5),
    (32, 1, 1, 64, 5), (32, 4, 2, 128, None), (32, 8, 1, 64, 40),
    (16, 3, 2, 64, 9), (8, 16, 1, 64, None),  # a group that is not a power of two; a wide one
]


@pytest.mark.parametrize("block_size,group,h_kv,d,window", REF_CASES)
def test_reference_matches_dense(kh, block_size, group, h_kv, d, window) -> None:
    q_lens, seq_lens = kh.mix(block_size)
    b = kh.make_batch(q_lens, seq_lens, block_size, h_kv, group, d, seed=block_size * group + d)
    want = kh.dense_attention(b, window)
    _assert_close(kh, _run(paged_attention_ref, b, sliding_window=window), want)
    # Without return_lse the reference takes its fused SDPA path.
    out = torch.full_like(b.q, math.nan)
    assert paged_attention_ref(b.q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                               b.scale, sliding_window=window) is None
    assert kh.rel_err(out, want[0]) <= kh.TOL[torch.float32]


@pytest.mark.parametrize("window", [None, 5])
def test_one_plan_serves_every_layer(kh, window) -> None:
    """The engine builds the torch path's plan once per step (the first layer, through the
    ``plans`` cache) and every later layer reuses it with its own q and KV pool: each layer's
    result must still equal float64 dense attention over that layer's own data."""
    q_lens, seq_lens = kh.mix(16)
    # float64: float32 on CPU takes the compiled kernel, which needs no plan.
    layers = [kh.make_batch(q_lens, seq_lens, 16, 2, 4, 64, dtype=torch.float64, seed=s)
              for s in (1, 2)]
    # Same metadata, other data: the second layer reads the first's block table.
    layers[1].block_table.copy_(layers[0].block_table)
    for r, n in enumerate(seq_lens):
        k, v = layers[1].keys[r], layers[1].values[r]
        pos = torch.arange(n)
        slot = layers[0].block_table[r, pos // 16].long() * 16 + pos % 16
        reshape_and_cache_ref(k, v, layers[1].caches[0], slot)
    plans: dict = {}
    for b in layers:
        got = _run(paged_attention, b, plans=plans, sliding_window=window)
        _assert_close(kh, got, kh.dense_attention(b, window), torch.float64)
    assert len(plans) == 1
    plan = next(iter(plans.values()))
    with pytest.raises(KernelArgumentError, match="plan"):
        _run(paged_attention_ref, layers[0], plan=plan, sliding_window=3)
    other = plan_paged_attention(layers[0].cu_seqlens_q, layers[0].seq_lens,
                                 layers[0].block_table, block_size=16, num_kv_heads=2,
                                 num_q_heads=8, head_dim=64, sliding_window=window,
                                 dtype=torch.float64)
    assert len(other.launches) == len(plan.launches)


@pytest.mark.parametrize("dtype,d", [
    (torch.float64, 64), (torch.float32, 72), (torch.float32, 100),
    (torch.bfloat16, 128), (torch.float16, 64),
])
def test_reference_other_dtypes_and_head_dims(kh, dtype, d) -> None:
    q_lens, seq_lens = kh.mix(8)
    b = kh.make_batch(q_lens, seq_lens, 8, 2, 2, d, dtype=dtype, seed=d)
    _assert_close(kh, _run(paged_attention_ref, b, sliding_window=9), kh.dense_attention(b, 9),
                  dtype)


TRITON_CASES = [
    (8, 4, 2, 64, None, None),
    (16, 8, 1, 128, 5, None),
    (32, 1, 2, 64, 40, None),
    # Split-KV path, merged by the merge kernel: one interpreted program per (token, query
    # head), so 4 query heads (two kv heads: the scratch's head offsets) rather than 8.
    (16, 2, 2, 128, None, 3),
    (8, 1, 1, 64, 5, 2),
    (16, 3, 2, 64, 9, None),  # GROUP_PAD 4: the padding head rows must stay masked
]


@pytest.mark.parametrize("block_size,group,h_kv,d,window,splits", TRITON_CASES)
def test_triton_matches_reference_and_dense(kh, block_size, group, h_kv, d, window, splits):
    q_lens, seq_lens = kh.mix(block_size)
    b = kh.make_batch(q_lens, seq_lens, block_size, h_kv, group, d, seed=block_size + group)
    got = _run(triton_paged_attention, b, sliding_window=window, num_kv_splits=splits)
    _assert_close(kh, got, _run(paged_attention_ref, b, sliding_window=window))
    _assert_close(kh, got, kh.dense_attention(b, window))


def test_triton_float16(kh) -> None:
    # bfloat16 is checked on GPU only: the interpreter's tl.dot mishandles bf16 operands.
    b = kh.make_batch(*kh.mix(16), 16, 2, 4, 64, dtype=torch.float16, seed=11)
    _assert_close(kh, _run(triton_paged_attention, b, sliding_window=21),
                  kh.dense_attention(b, 21), torch.float16)


def _cp_check(kh, attn, merge, block_size, group, cp_size, interleave, window=None, **kw):
    """Shard the KV over cp_size ranks, attend per rank, merge; must equal one rank's result."""
    q_lens = [12, 5, 1, 1, 1, 1, 1]
    # Prefill over a multiple of every W; continuation; decodes shorter than W, a multiple of W,
    # and long ones.
    seq_lens = [12, 5 + 3 * block_size, 1, 2, 24, 77, 2 * block_size * cp_size]
    seed = 100 * cp_size + interleave + group
    sharded = kh.make_batch(q_lens, seq_lens, block_size, 1, group, 64, cp_size=cp_size,
                            cp_interleave=interleave, seed=seed)
    outs, lses = [], []
    for rank in range(cp_size):
        out, lse = _run(attn, sharded, sharded.caches[rank], cp=CPLayout(rank, cp_size, interleave),
                        sliding_window=window, **kw)
        # A query whose rank holds no visible key: lse -inf and output exactly 0.
        empty = torch.isinf(lse)
        assert (lse[empty] == -math.inf).all()
        assert (out[empty] == 0).all()
        outs.append(out)
        lses.append(lse)
    # Rank 1 stores nothing of the length-1 sequence (token 0 lives on rank 0).
    assert torch.isinf(lses[1][int(sharded.cu_seqlens_q[2])]).all()
    merged = merge(torch.stack(outs), torch.stack(lses))
    _assert_close(kh, merged, kh.dense_attention(sharded, window))
    single = kh.make_batch(q_lens, seq_lens, block_size, 1, group, 64, seed=seed)
    _assert_close(kh, merged, _run(paged_attention_ref, single, sliding_window=window))


@pytest.mark.parametrize("block_size,group,cp_size,interleave,window", [
    (8, 1, 2, 1, None), (16, 4, 2, 16, None), (32, 8, 3, 1, None),
    (8, 4, 3, 8, 7), (16, 1, 4, 1, 20), (32, 4, 4, 32, None),
])
def test_reference_context_parallel(kh, block_size, group, cp_size, interleave, window):
    _cp_check(kh, paged_attention_ref, merge_attn_states, block_size, group, cp_size,
              interleave, window)


@pytest.mark.parametrize("block_size,group,cp_size,interleave,window,splits", [
    (8, 4, 3, 1, None, None), (16, 8, 2, 16, None, None), (16, 1, 4, 1, None, 2),
    (32, 4, 3, 32, 11, None),
])
def test_triton_context_parallel(kh, block_size, group, cp_size, interleave, window, splits):
    _cp_check(kh, triton_paged_attention, triton_merge_attn_states, block_size, group, cp_size,
              interleave, window, num_kv_splits=splits)


def test_triton_rejects_odd_head_dim(kh) -> None:
    b = kh.make_batch([3, 1], [3, 9], 8, 1, 4, 72, seed=2)
    with pytest.raises(KernelArgumentError, match="head_dim.*powers of two.*72"):
        _run(triton_paged_attention, b)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref, triton_paged_attention])
def test_rejects_bad_arguments(kh, fn) -> None:
    b = kh.make_batch([3, 1], [3, 9], 8, 2, 2, 64, seed=3)
    q, cache, cu, lens, table = b.q, b.caches[0], b.cu_seqlens_q, b.seq_lens, b.block_table
    out = torch.empty_like(q)

    def call(**over):
        args = dict(q=q, kv_cache=cache, out=out, cu_seqlens_q=cu, seq_lens=lens,
                    block_table=table, softmax_scale=b.scale)
        kw = {k: over.pop(k) for k in list(over) if k.startswith(("cp", "sliding"))}
        args.update(over)
        return fn(**args, **kw)

    with pytest.raises(KernelDtypeError, match="cu_seqlens_q"):
        call(cu_seqlens_q=cu.long())
    with pytest.raises(KernelDtypeError, match="share a dtype"):
        call(q=q.half(), out=out.half())
    with pytest.raises(KernelArgumentError, match="multiple of num_kv_heads"):
        call(q=q[:, :3], out=out[:, :3])
    with pytest.raises(KernelArgumentError, match="out shape"):
        call(out=out[:-1])
    with pytest.raises(KernelArgumentError, match="num_seqs \\+ 1"):
        call(cu_seqlens_q=cu[:-1])
    with pytest.raises(KernelArgumentError, match="contiguous"):
        call(kv_cache=cache.transpose(3, 4))
    with pytest.raises(KernelArgumentError, match="cp_interleave"):
        call(cp=CPLayout(0, 2, 3))
    with pytest.raises(KernelArgumentError, match="cp_rank"):
        call(cp=CPLayout(2, 2))
    with pytest.raises(KernelArgumentError, match="sliding_window"):
        call(sliding_window=0)
