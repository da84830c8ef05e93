"""The compiled whole-layer call against its torch reference at float64: one step of a chunked
prefill over cached context, a fresh prompt and a decode in one batch, with GQA, a QKV bias and
a sliding window, plain and oneDNN-packed weights, float32 and bfloat16. The output, the
residual stream and the KV written all follow float64."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.kernels.decoder_layer import (
    LayerWeights,
    decoder_layer,
    decoder_layer_ref,
    projection,
)
from pagedserve.kernels.errors import KernelArgumentError
from pagedserve.kernels.linear import pack_weight, packs

H, HQ, HKV, D, INTER, B, NB = 64, 4, 2, 16, 96, 4, 24
TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels.cpu_ops() is not None, "the compiled CPU kernels did not build"


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.3: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    linears = [r(HQ * D + 2 * HKV * D, H), r(H, HQ * D), r(2 * INTER, H), r(H, INTER)]
    norms = [1 + r(H, scale=0.1), 1 + r(H, scale=0.1)]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.arange(64, dtype=torch.float64)[:, None] * inv[None, :]
    # Sequences: 5 new tokens after 9 cached, a fresh 6-token prompt, one decode after 12.
    cached, new = [9, 0, 12], [5, 6, 1]
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    perm = torch.randperm(NB - 1, generator=g) + 1  # scattered block ids, 0 unused
    table = torch.zeros(3, 5, dtype=torch.int32)
    slots, positions, nxt = [], [], 0
    for s, length in enumerate(lens):
        nblk = -(-length // B)
        table[s, :nblk] = perm[nxt:nxt + nblk].int()
        nxt += nblk
        for p in range(cached[s], length):
            slots.append(int(table[s, p // B]) * B + p % B)
            positions.append(p)
    cache = torch.zeros(NB, 2, B, HKV, D, dtype=torch.float64)
    for s in range(3):  # the cached context's K/V
        for p in range(cached[s]):
            blk, off = int(table[s, p // B]), p % B
            cache[blk, :, off] = r(2, HKV, D, scale=1.0)
    t = sum(new)
    return dict(
        linears=linears, norms=norms, bias=r(HQ * D + 2 * HKV * D), cos=freqs.cos().float(),
        sin=freqs.sin().float(), x=r(t, H, scale=1.0), residual=r(t, H, scale=1.0),
        positions=torch.tensor(positions), cache=cache, slots=torch.tensor(slots),
        cu=torch.tensor([0, 5, 11, 12], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), table=table)


def _run_ref(c, window, first: bool):
    x, cache = c["x"].clone(), c["cache"].clone()
    residual = None if first else c["residual"].clone()
    out, res = decoder_layer_ref(
        c["norms"][0], c["norms"][1], 1e-6, c["linears"], c["bias"], HQ, HKV, c["cos"], c["sin"],
        D**-0.5, window, x, residual, c["positions"], cache, c["slots"], c["cu"], c["seq_lens"],
        c["table"])
    return out, res, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window,first", [(None, False), (7, False), (None, True)])
def test_the_compiled_layer_follows_float64(dtype, packed, window, first) -> None:
    if packed and not packs(dtype):
        pytest.skip(f"no packed {dtype} matmul on this CPU")
    c = _case(seed=3)
    want_out, want_res, want_cache = _run_ref(c, window, first)
    held = [projection(w.to(dtype), pack_weight(w.to(dtype)) if packed else None, None)
            for w in c["linears"]]
    w = LayerWeights(
        input_norm=c["norms"][0].to(dtype), post_norm=c["norms"][1].to(dtype), eps=1e-6,
        linears=tuple(t for _, ts in held for t in ts), kinds=tuple(k for k, _ in held),  # type: ignore[arg-type]
        qkv_bias=c["bias"].to(dtype), num_heads=HQ,
        num_kv_heads=HKV, cos=c["cos"], sin=c["sin"], scale=D**-0.5, sliding_window=window)
    x = c["x"].to(dtype)
    residual = None if first else c["residual"].to(dtype)
    cache = c["cache"].to(dtype)
    out, res = decoder_layer(w, x, residual, c["positions"], cache, c["slots"], c["cu"],
                             c["seq_lens"], c["table"])
    assert out.dtype == res.dtype == dtype and out.shape == res.shape == (12, H)
    assert res.data_ptr() == (x if first else residual).data_ptr()  # the stream, in place
    assert _rel(out, want_out) <= TOL[dtype]
    assert _rel(res, want_res) <= TOL[dtype]
    assert _rel(cache, want_cache) <= TOL[dtype]


def test_a_block_table_past_the_pool_is_a_typed_error() -> None:
    c = _case(seed=4)
    c["table"][2, 0] = NB + 5
    f = torch.float32
    w = LayerWeights(
        input_norm=c["norms"][0].to(f), post_norm=c["norms"][1].to(f), eps=1e-6,
        linears=tuple(x.to(f) for x in c["linears"]), kinds=(0, 0, 0, 0), qkv_bias=None,
        num_heads=HQ, num_kv_heads=HKV, cos=c["cos"], sin=c["sin"], scale=D**-0.5,
        sliding_window=None)
    with pytest.raises(KernelArgumentError, match="sequence 2"):
        decoder_layer(w, c["x"].float(), c["residual"].float(), c["positions"],
                      c["cache"].float(), c["slots"], c["cu"], c["seq_lens"], c["table"])
