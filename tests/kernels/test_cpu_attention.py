"""The compiled CPU paged-attention kernel against float64 dense attention and the torch
reference: the same batches as the reference's tests (prefill, chunked continuation over cached
context, multi-token steps, decodes; scattered block ids, unused table entries outside the
cache), every block size against every GQA ratio, windows, the LSE, strided q, long prefills
that span several of the kernel's query tiles, and the typed errors for metadata it cannot
follow. The kernel is built by the first test (a C++ compiler is part of the install)."""

from __future__ import annotations

import math

import pytest
import torch

import pagedserve.kernels as kernels_mod
from pagedserve.kernels import (
    KernelArgumentError,
    cpu_paged_attention,
    paged_attention,
    paged_attention_ref,
)
from pagedserve.kernels import cpu as cpu_kernels


def _cpu(b, window=None, lse=True, q=None):
    q = b.q if q is None else q
    out = torch.full(q.shape, math.nan)
    got = cpu_paged_attention(q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                              b.scale, window, lse)
    return out, got


def test_kernel_builds() -> None:
    assert cpu_kernels.cpu_ops() is not None, "the compiled CPU kernel did not build"


CASES = [
    (8, 1, 2, 64, None), (8, 4, 2, 128, 5), (8, 8, 1, 64, 40),
    (16, 1, 2, 128, 40), (16, 4, 1, 64, None), (16, 8, 2, 128, 5),
    (32, 1, 1, 64, 5), (32, 4, 2, 128, None), (32, 8, 1, 64, 40),
    (16, 3, 2, 72, 9), (8, 16, 1, 100, None),  # odd group and head dims
    # head dim 32, blocks of 64 (four 16-key chunks each) and of 4 (a chunk ends each block)
    (64, 2, 2, 32, 23), (4, 3, 1, 32, None),
]


@pytest.mark.parametrize("block_size,group,h_kv,d,window", CASES)
def test_matches_dense(kh, block_size, group, h_kv, d, window) -> None:
    b = kh.make_batch(*kh.mix(block_size), block_size, h_kv, group, d, seed=block_size + d)
    want_out, want_lse = kh.dense_attention(b, window)
    out, lse = _cpu(b, window)
    assert kh.rel_err(out, want_out) <= kh.TOL[torch.float32]
    assert kh.rel_err(lse, want_lse) <= kh.TOL[torch.float32]
    out2, none = _cpu(b, window, lse=False)
    assert none is None and torch.equal(out2, out)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# (group, kv heads, head dim, window, dtype); group 5 is more rows than the vector path holds
# at once, so its decodes stay one kv head an item.
MANY_DECODES = [
    (3, 3, 64, None, torch.float32), (1, 4, 64, 9, torch.bfloat16),
    (4, 2, 64, None, torch.bfloat16),
    (2, 3, 128, 23, torch.float32), (2, 2, 32, None, torch.float32), (5, 2, 64, 40, torch.float32),
]


@pytest.mark.parametrize("group,h_kv,d,window,dtype", MANY_DECODES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_decodes(kh, threads, num_threads, group, h_kv, d, window, dtype) -> None:
    # 26 decodes, enough that the kernel takes each decode's kv heads as one item, which reads
    # a block's rows of every head together: lengths around block edges, 1 and a long one.
    threads(num_threads)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 80, 95, 96, 97, 120, 128, 129,
            150, 160, 161, 200, 255, 300]
    b = kh.make_batch([1] * len(lens), lens, 16, h_kv, group, d, dtype=dtype, seed=d + group)
    want_out, want_lse = kh.dense_attention(b, window)
    out = torch.full(b.q.shape, math.nan, dtype=dtype)
    lse = cpu_paged_attention(b.q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                              b.scale, window, True)
    assert kh.rel_err(out, want_out) <= (2.0**-8 if dtype == torch.bfloat16 else 1e-5)
    assert kh.rel_err(lse, want_lse) <= 1e-5


# (sequences: (new tokens, length) each, group, kv heads, head dim, window, dtype, split on two
# threads; None: not checked, a bf16 output can round both ways to the same bits)
ONE_STREAM = [
    ([(1, 600)], 3, 3, 64, None, torch.float32, True),  # SmolLM2's heads: 3 items, 2 threads
    ([(1, 600)], 3, 3, 64, None, torch.bfloat16, None),
    ([(1, 1000)], 3, 3, 64, 700, torch.float32, True),  # a window: parts start inside it
    ([(1, 1000)], 3, 3, 64, 300, torch.float32, False),  # too few keys in the window to split
    ([(1, 500)], 2, 1, 128, None, torch.float32, False),  # too few keys for two parts of 256
    ([(1, 777)], 4, 1, 32, None, torch.float32, True),
    ([(1, 600), (17, 400)], 1, 1, 64, None, torch.float32, True),  # beside a prefill's tiles
    ([(1, 600), (1, 700)], 2, 2, 64, None, torch.float32, True),  # two streams
    ([(1, 600)] * 8, 2, 2, 64, None, torch.float32, False),  # eight items: enough to share
]


@pytest.mark.parametrize("seqs,group,h_kv,d,window,dtype,split", ONE_STREAM)
def test_a_lone_decode_splits_its_keys(kh, threads, seqs, group, h_kv, d, window, dtype,
                                       split) -> None:
    """Fewer items than four a thread: a long decode's keys (its kv heads together) are split
    into parts that the threads share, merged by their maxima and sums. float64 attention's
    answer on one thread and on two; the two differ in their last bits exactly where the split
    happened."""
    b = kh.make_batch([q for q, _ in seqs], [n for _, n in seqs], 16, h_kv, group, d,
                      dtype=dtype, seed=d + group)
    want_out, want_lse = kh.dense_attention(b, window)
    got = {}
    for num_threads in (1, 2):
        threads(num_threads)
        out = torch.full(b.q.shape, math.nan, dtype=dtype)
        lse = cpu_paged_attention(b.q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens,
                                  b.block_table, b.scale, window, True)
        # bf16: the probabilities are rounded to bf16 for P V; over 600 keys the output is a
        # small average, which those roundings move by more than one rounding of the result
        # (2^-8, test_cpu_bf16.py's bound, read 0.0045 here without a split).
        assert kh.rel_err(out, want_out) <= (2.0**-7 if dtype == torch.bfloat16 else 1e-5)
        assert kh.rel_err(lse, want_lse) <= 1e-5
        got[num_threads] = out, lse
    same = all(torch.equal(x, y) for x, y in zip(got[1], got[2], strict=True))
    assert split is None or same != split


@pytest.mark.parametrize("window", [None, 23])
def test_long_prefill_spans_query_tiles(kh, window) -> None:
    # 70 and 45 new tokens over cached context: several 16-query tiles per sequence, a window
    # that starts inside a block, and a decode beside them.
    b = kh.make_batch([70, 45, 1], [70, 45 + 37, 130], 16, 2, 4, 64, seed=9)
    want = kh.dense_attention(b, window)
    out, lse = _cpu(b, window)
    assert kh.rel_err(out, want[0]) <= kh.TOL[torch.float32]
    assert kh.rel_err(lse, want[1]) <= kh.TOL[torch.float32]


def test_strided_q_and_out(kh) -> None:
    """q as the model hands it over: a view into a fused qkv projection (token stride wider
    than H_q * D); out a view too."""
    b = kh.make_batch(*kh.mix(16), 16, 2, 2, 64, seed=4)
    t, hq, d = b.q.shape
    fused = torch.randn(t, 3 * hq * d)
    q = fused[:, : hq * d].view(t, hq, d)
    q.copy_(b.q)
    wide = torch.full((t, 2 * hq * d), math.nan)
    out = wide[:, hq * d:].view(t, hq, d)
    cpu_paged_attention(q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                        b.scale, None, False)
    assert kh.rel_err(out, kh.dense_attention(b)[0]) <= kh.TOL[torch.float32]
    assert torch.isnan(wide[:, : hq * d]).all()  # nothing written outside out


@pytest.mark.parametrize("window", [None, 9])
def test_engine_dispatch_sends_prefills_to_the_kernel(kh, window, monkeypatch) -> None:
    """As the engine calls it (with the step's plan cache), a step with a 19-token prefill
    beside decodes is one kernel call and builds no torch plan."""
    b = kh.make_batch(*kh.mix(16), 16, 2, 4, 64, seed=12)
    monkeypatch.setattr(kernels_mod, "paged_attention_ref", None)  # any torch-path call fails
    plans: dict = {}
    out = torch.full_like(b.q, math.nan)
    assert paged_attention(b.q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                           b.scale, sliding_window=window, plans=plans) is None
    assert kh.rel_err(out, kh.dense_attention(b, window)[0]) <= kh.TOL[torch.float32]
    assert plans == {}


def test_dispatcher_on_cpu(kh, monkeypatch) -> None:
    """float32 on CPU takes the compiled kernel; float64, and float32 when the kernel cannot be
    built, take the torch reference (bit for bit)."""
    b = kh.make_batch(*kh.mix(16), 16, 2, 4, 64, seed=5)
    out = torch.empty_like(b.q)
    lse = paged_attention(b.q, b.caches[0], out, b.cu_seqlens_q, b.seq_lens, b.block_table,
                          b.scale, return_lse=True)
    want = _cpu(b)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    b64 = kh.make_batch(*kh.mix(16), 16, 2, 4, 64, dtype=torch.float64, seed=5)
    for batch in (b64, b):
        if batch is b:
            monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: None)
            monkeypatch.setattr("pagedserve.kernels.cpu_ops", lambda: None)
        got, ref = torch.empty_like(batch.q), torch.empty_like(batch.q)
        args = (batch.caches[0], batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
        paged_attention(batch.q, args[0], got, *args[1:], batch.scale)
        paged_attention_ref(batch.q, args[0], ref, *args[1:], batch.scale)
        assert torch.equal(got, ref)


def test_rejects_metadata_it_cannot_follow(kh) -> None:
    b = kh.make_batch([3, 1], [3, 9], 8, 2, 2, 64, seed=3)

    def call(**over):
        args = dict(q=b.q, kv_cache=b.caches[0], out=torch.empty_like(b.q),
                    cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens,
                    block_table=b.block_table, softmax_scale=b.scale)
        args.update(over)
        return paged_attention(**args)

    with pytest.raises(KernelArgumentError, match="sequence 0"):
        call(seq_lens=torch.tensor([2, 9], dtype=torch.int32))  # 3 new tokens, length 2
    with pytest.raises(KernelArgumentError, match="sequence 1"):
        call(seq_lens=torch.tensor([3, 9 + 8 * b.block_table.shape[1]], dtype=torch.int32))
    table = b.block_table.clone()
    table[1, 0] = b.caches[0].shape[0]  # one past the pool
    with pytest.raises(KernelArgumentError, match="sequence 1"):
        call(block_table=table)
