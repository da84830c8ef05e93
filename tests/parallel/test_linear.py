"""Parallel layers: rank slices of a full checkpoint tensor reassemble it, and at size 1 the
layers are plain linears / embeddings with no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.parallel import comm
from pagedserve.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.parallel.state import ParallelState, divide


def load(layer, name: str, full: torch.Tensor, *shard) -> torch.Tensor:
    param = getattr(layer, name)
    param.weight_loader(param, full, *shard)
    return param.data


def test_state_and_divide():
    s = ParallelState()
    assert s.is_single and s.group is None
    with pytest.raises(ValueError):
        ParallelState(2, 2)
    with pytest.raises(dataclass_error()):
        s.rank = 1  # frozen
    assert divide(12, 4) == 3
    with pytest.raises(ValueError):
        divide(10, 4)


def dataclass_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_collectives_are_noops_at_size_one():
    x = torch.randn(3, 4)
    s = ParallelState()
    assert comm.all_reduce(x, s) is x and comm.all_gather(x, s) is x
    assert comm.reduce_scatter(x, s) is x and comm.broadcast(x, s) is x


def test_size_one_layers_are_plain():
    s = ParallelState()
    x = torch.randn(5, 8)
    w, b = torch.randn(6, 8), torch.randn(6)
    col = ColumnParallelLinear(8, 6, True, s)
    load(col, "weight", w)
    load(col, "bias", b)
    assert torch.allclose(col(x), F.linear(x, w, b))
    row = RowParallelLinear(8, 6, True, s)
    load(row, "weight", w)
    load(row, "bias", b)
    assert torch.allclose(row(x), F.linear(x, w, b))
    emb = VocabParallelEmbedding(10, 8, s)
    table = torch.randn(10, 8)
    load(emb, "weight", table)
    ids = torch.tensor([0, 9, 3])
    assert torch.equal(emb(ids), table[ids])
    head = ParallelLMHead(10, 8, s)
    head.tie_to(emb)
    assert torch.allclose(head(x), x @ table.T)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_reassemble(tp):
    w = torch.randn(8, 12)
    cols = [
        load(ColumnParallelLinear(12, 8, False, ParallelState(r, tp)), "weight", w)
        for r in range(tp)
    ]
    assert torch.equal(torch.cat(cols, 0), w)
    rows = [
        load(RowParallelLinear(12, 8, False, ParallelState(r, tp)), "weight", w) for r in range(tp)
    ]
    assert torch.equal(torch.cat(rows, 1), w)
    # Row parallel: the sum of the rank partials is the full product (what all_reduce does).
    x = torch.randn(3, 12)
    parts = [F.linear(x.chunk(tp, -1)[r], rows[r]) for r in range(tp)]
    assert torch.allclose(sum(parts), F.linear(x, w), atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_places_each_projection(tp):
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for r in range(tp):
        layer = MergedColumnParallelLinear(4, [8, 8], False, ParallelState(r, tp))
        load(layer, "weight", gate, 0)
        w = load(layer, "weight", up, 1)
        n = 8 // tp
        assert torch.equal(w, torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]]))


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_qkv_shards_by_heads_and_replicates_kv(tp, kv_heads):
    heads, d, hidden = 4, 3, 5
    q = torch.randn(heads * d, hidden)
    k = torch.randn(kv_heads * d, hidden)
    v = torch.randn(kv_heads * d, hidden)
    qs, ks, vs = [], [], []
    for r in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, False, ParallelState(r, tp))
        for name, full in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", full, name)
        wq, wk, wv = layer.weight.data.split([layer.q_size, layer.kv_size, layer.kv_size])
        qs.append(wq)
        ks.append(wk)
        vs.append(wv)
        # Rank r's query heads attend to the KV head it holds (GQA grouping is preserved).
        first_q_head = r * layer.num_heads
        assert layer.kv_head_start == first_q_head // (heads // kv_heads)
    assert torch.equal(torch.cat(qs), q)
    if tp <= kv_heads:
        assert torch.equal(torch.cat(ks), k) and torch.equal(torch.cat(vs), v)
    else:  # replicated: every KV head appears tp / kv_heads times, in order
        rep = tp // kv_heads
        assert torch.equal(
            torch.cat(ks), k.view(kv_heads, d, hidden).repeat_interleave(rep, 0).reshape(-1, hidden)
        )


def test_vocab_parallel_shards_with_padding():
    table = torch.randn(10, 4)
    shards = [
        load(VocabParallelEmbedding(10, 4, ParallelState(r, 3)), "weight", table) for r in range(3)
    ]
    assert [s.shape[0] for s in shards] == [4, 4, 4]
    assert torch.equal(torch.cat(shards)[:10], table)
    assert not shards[2][2:].any()  # padding rows past the vocabulary stay zero
