"""The linear layers' packed CPU matmuls (the tiled kernel, oneDNN's) against float64 torch, and
the layers after packing."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.cpu_caps import has_native_bf16
from pagedserve.kernels.linear import (
    PACK_MIN_ELEMENTS,
    is_tiled,
    linear,
    linear_ref,
    pack_weight,
    packs,
    tile_weight,
    tiles,
    untile_weight,
)
from pagedserve.parallel.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_weights,
)
from pagedserve.parallel.state import ParallelState


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.fixture(autouse=True)
def _packs() -> None:
    if pack_weight(torch.ones(2, 2)) is None:
        pytest.skip("this torch has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(rows, bias) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(130, 96, generator=g)
    b = torch.randn(130, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = pack_weight(w)
    got = linear(x, None, packed, b)
    want = linear_ref(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, 130) and got.dtype == torch.float32
    assert _rel(got, want) <= 1e-6


def test_packed_linear_takes_views_and_more_dims() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=g)
    packed = pack_weight(w)
    wide = torch.randn(9, 64, generator=g)
    x = wide[:, ::2]  # strided: every other column
    assert _rel(linear(x, None, packed), linear_ref(x.double(), w.double(), None)) <= 1e-6
    x3 = torch.randn(3, 5, 32, generator=g)
    got = linear(x3, None, packed)
    assert got.shape == (3, 5, 40)
    assert _rel(got, linear_ref(x3.double(), w.double(), None)) <= 1e-6


def test_only_cpu_float32_and_fast_bf16_are_packed() -> None:
    assert pack_weight(torch.ones(4, 4, dtype=torch.float64)) is None
    assert pack_weight(torch.ones(4, 4, dtype=torch.float16)) is None
    # bf16 where the tiled kernel takes it (AVX512-BF16, or AVX2 widening the weights) or the CPU
    # has bf16 instructions for oneDNN; elsewhere F.linear keeps the plain weight.
    packed_bf16 = pack_weight(torch.ones(32, 4, dtype=torch.bfloat16))
    fast = tiles(torch.bfloat16) or has_native_bf16()
    assert (packed_bf16 is not None) == fast == packs(torch.bfloat16)
    # No packed weight: the plain one serves, as F.linear would.
    w = torch.randn(6, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(linear(x, w, None), linear_ref(x, w, None))


def test_packing_a_model_replaces_weights_and_keeps_outputs() -> None:
    g = torch.Generator().manual_seed(2)
    state = ParallelState()
    col = ColumnParallelLinear(256, 1024, True, state)  # PACK_MIN_ELEMENTS: the smallest packed
    row = RowParallelLinear(1024, 256, True, state)
    small = ColumnParallelLinear(256, 256, False, state)  # below PACK_MIN_ELEMENTS: kept plain
    emb = VocabParallelEmbedding(1024, 256, state)
    head = ParallelLMHead(1024, 256, state)
    head.tie_to(emb)
    model = torch.nn.ModuleList([col, row, small, emb, head])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(5, 256, generator=g)
    ids = torch.tensor([3, 1023, 0])

    def run() -> list[torch.Tensor]:
        return [row(col(x)), small(x), emb(ids), head(x)]

    assert small.weight.numel() < PACK_MIN_ELEMENTS <= col.weight.numel()
    before = run()
    assert pack_weights(model) == 3
    # The linears hold only the packed copy; the tied head keeps the weight its embedding reads.
    assert col.weight is None and row.weight is None and col.packed is not None
    assert small.packed is None and small.weight is not None
    assert head.weight is emb.weight and head.packed is not None
    # Shapes of 32 | out take the tiled kernel wherever the build has it.
    assert is_tiled(col.packed) == is_tiled(row.packed) == tiles(torch.float32)
    for got, want in zip(run(), before, strict=True):
        assert got.shape == want.shape
        assert _rel(got, want) <= 1e-5


@pytest.mark.skipif(not packs(torch.bfloat16), reason="no fast bf16 matmul: bf16 keeps F.linear")
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("n", [128, 130])  # tiles; does not (oneDNN's where it has bf16)
def test_packed_bf16_linear_matches_float64(rows, n) -> None:
    """Where bf16 is packed (tiled, or oneDNN's on AVX512-BF16 / AMX): the bf16 products are
    summed in float32 and rounded once, so the result is within a bf16 rounding (2^-8 relative)
    of float64 on the same bf16 inputs, and within that of F.linear's own bf16 result."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, 96, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = pack_weight(w)
    if packed is None:
        pytest.skip("this shape does not tile, and oneDNN has no bf16 matmul on this CPU")
    got = linear(x, None, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = linear_ref(x.double(), w.double(), b.double())
    assert _rel(got, want) <= 2**-7
    assert _rel(got, linear_ref(x, w, b)) <= 2**-7


# The tiled kernel's tolerance per dtype against float64 on the same inputs: float32 sums of a
# few hundred products; bf16 products are exact and summed in float32, then rounded once.
TILED_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(64, 32), (96, 200), (32, 14)])
def test_tiled_linear_matches_float64(dtype, rows, n, k) -> None:
    """Every row path of the kernel (one to four rows in one pass, blocks of up to eight, chunks
    of 64) and an odd number of k steps, with and without a bias."""
    if not tiles(dtype):
        pytest.skip(f"no tiled {dtype} kernel in this build (needs AVX2 with FMA or AVX-512)")
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    packed = pack_weight(w)
    assert packed is not None and is_tiled(packed)
    assert torch.equal(untile_weight(packed), w)
    for bias in (None, b):
        got = linear(x, None, packed, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = linear_ref(x.double(), w.double(), None if bias is None else bias.double())
        assert _rel(got, want) <= TILED_TOL[dtype]


def test_tiled_bf16_rounds_each_output_as_torch_does() -> None:
    """One nonzero k: each output is one exact product, so the kernel's single rounding to bf16
    must equal torch's round to nearest even bit for bit, and a NaN row stays NaN."""
    if not tiles(torch.bfloat16):
        pytest.skip("no tiled bf16 kernel in this build")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 2, generator=g).bfloat16()
    x = torch.randn(9, 2, generator=g).bfloat16()
    w[:, 1] = 0
    x[:, 1] = 0
    x[0, 0] = float("nan")
    got = linear(x, None, pack_weight(w))
    assert torch.equal(got[1:], (x[1:].float() @ w.float().T).bfloat16())
    assert got[0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_reads_views(dtype) -> None:
    """Strided rows, an odd row stride and an odd start (bf16 reads k in 32-bit pairs), and
    leading dims."""
    if not tiles(dtype):
        pytest.skip(f"no tiled {dtype} kernel in this build")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 48, generator=g).to(dtype)
    packed = pack_weight(w)
    wide = torch.randn(7, 97, generator=g).to(dtype)
    for x in (wide[:, :48], wide[:, 1:49], wide[:, ::2][:, :48], wide[:3, 2:50]):
        want = linear_ref(x.double(), w.double(), None)
        assert _rel(linear(x, None, packed), want) <= TILED_TOL[dtype]
    x3 = torch.randn(2, 3, 48, generator=g).to(dtype)
    got = linear(x3, None, packed)
    assert got.shape == (2, 3, 64)
    assert _rel(got, linear_ref(x3.double(), w.double(), None)) <= TILED_TOL[dtype]


def test_the_tiled_layout_and_who_takes_it() -> None:
    w = torch.arange(64 * 6, dtype=torch.float32).view(64, 6)
    t32 = tile_weight(w)
    assert t32.shape == (2, 6, 32) and t32[1, 4, 3] == w[32 + 3, 4]
    t16 = tile_weight(w.bfloat16())
    assert t16.shape == (2, 3, 32, 2) and t16[1, 2, 5, 1] == w[32 + 5, 2 * 2 + 1].bfloat16()
    assert torch.equal(untile_weight(t32), w) and torch.equal(untile_weight(t16), w.bfloat16())
    # Shapes that do not tile (N not a multiple of 32; an odd K at bf16) go to oneDNN, if any.
    for shape, dtype in (((40, 32), torch.float32), ((64, 33), torch.bfloat16)):
        packed = pack_weight(torch.ones(shape, dtype=dtype))
        assert packed is None or not is_tiled(packed)


def test_the_tiled_ops_refuse_what_they_cannot_read() -> None:
    """A clear error, never a wrong product: columns that do not match the weight, a dtype the
    op does not take, a weight not in the tiled layout, a bias of another length."""
    if not tiles(torch.float32):
        pytest.skip("no tiled kernel in this build")
    ops = cpu_ops()
    w = pack_weight(torch.randn(64, 48))
    with pytest.raises(RuntimeError, match="columns"):
        ops.linear_tiled(torch.randn(2, 40), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear_tiled(torch.randn(2, 48, dtype=torch.float64), w, None)
    with pytest.raises(RuntimeError, match="tiled weight"):
        ops.linear_tiled(torch.randn(2, 48), torch.randn(64, 48), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_tiled(torch.randn(2, 48), w, torch.randn(63))
    if tiles(torch.int8):
        offset, scale = torch.zeros(64, dtype=torch.int32), torch.ones(64)
        with pytest.raises(RuntimeError, match="int8 codes"):
            ops.int8_linear_tiled(torch.randn(2, 48), w, offset, scale, None)
        codes = tile_weight(torch.ones(64, 48, dtype=torch.int8))
        with pytest.raises(RuntimeError, match="offset"):
            ops.int8_linear_tiled(torch.randn(2, 48), codes, offset[:32], scale, None)
        # the result's dtype, and a bias in it (not in x's)
        with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
            ops.int8_linear_tiled(torch.randn(2, 48), codes, offset, scale, None, 0, torch.int32)
        with pytest.raises(RuntimeError, match="bias"):
            ops.int8_linear_tiled(torch.randn(2, 48).bfloat16(), codes, offset, scale,
                                  torch.zeros(64).bfloat16(), 0, torch.float32)
    if tiles(torch.bfloat16):  # four k a step, as int8 codes lie, but in bf16
        with pytest.raises(RuntimeError, match="tiled weight"):
            ops.linear_tiled(torch.randn(2, 48).bfloat16(),
                             torch.zeros(2, 12, 32, 4, dtype=torch.bfloat16), None)
