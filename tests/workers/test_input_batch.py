"""InputBatch: rows are added, appended, removed and condensed with their block-table rows."""

from __future__ import annotations

import pytest
import torch

from pagedserve.messages import PLACEHOLDER_TOKEN, NewRequestData, SamplingParams
from pagedserve.workers.block_table import BlockTable, MultiGroupBlockTable
from pagedserve.workers.input_batch import InputBatch

CPU = torch.device("cpu")


def make_batch(max_reqs: int = 4) -> InputBatch:
    tables = MultiGroupBlockTable([BlockTable(max_reqs, 8, 4, CPU) for _ in range(2)])
    return InputBatch(max_reqs, 32, 50, tables, CPU)


def new(rid: str, prompt: list[int], blocks: list[list[int]], **sp) -> NewRequestData:
    return NewRequestData(rid, prompt, [], SamplingParams(**sp), blocks, 0)


def test_add_append_remove_condense():
    b = make_batch()
    for i, rid in enumerate("abcd"):
        assert b.add_request(new(rid, [i] * (i + 1), [[10 + i], [20 + i]], top_k=i)) == i
    b.append_tokens("b", [7, 8])
    assert b.token_ids[1, :4].tolist() == [1, 1, 7, 8] and b.num_tokens[1] == 4
    b.remove_request("a")
    b.remove_request("c")
    assert b.num_reqs == 2 and b.req_ids == [None, "b", None, "d"]
    b.condense()
    assert b.req_ids[:2] == ["d", "b"] and b.req_ids[2:] == [None, None]
    assert b.index_of == {"d": 0, "b": 1}
    assert b.token_ids[0, :4].tolist() == [3, 3, 3, 3] and b.num_tokens[0] == 4
    assert b.columns["top_k"][0] == 3 and b.params[0].top_k == 3
    assert b.block_table[0].np[0, 0] == 13 and b.block_table[1].np[0, 0] == 23
    assert b.block_table[0].num_blocks.tolist() == [1, 1, 0, 0]
    # A new request takes the lowest free row.
    assert b.add_request(new("e", [5], [[30], [31]])) == 2


def test_resumed_request_keeps_its_outputs():
    # Its seeded noise needs no state: the sampler derives it from (seed, output index), and
    # the output index of the next sample is num_tokens - num_prompt_tokens.
    b = make_batch()
    req = NewRequestData("r", [1, 2], [3, 4, 5], SamplingParams(seed=7), [[1], [2]], 0)
    row = b.add_request(req)
    assert b.token_ids[row, :5].tolist() == [1, 2, 3, 4, 5]
    assert b.num_prompt_tokens[row] == 2 and b.num_tokens[row] == 5
    assert b.params[row].seed == 7


def test_readding_an_id_replaces_the_row():
    b = make_batch()
    b.add_request(new("x", [1, 2, 3], [[1], [2]]))
    b.add_request(new("x", [9], [[5], [6]]))
    assert b.num_reqs == 1 and b.token_ids[0, 0] == 9 and b.block_table[0].np[0, 0] == 5


def test_placeholders_take_the_latest_sample_and_refuse_without_one():
    b = make_batch()
    row = b.add_request(new("a", [1, 2], [[1], [2]]))
    # Nothing sampled yet for "a": a placeholder is a disagreement with the controller.
    with pytest.raises(ValueError, match="sampled nothing"):
        b.append_tokens("a", [PLACEHOLDER_TOKEN])
    assert b.num_tokens[row] == 2  # nothing appended
    b.last_sampled["a"] = 9
    b.append_tokens("a", [4, PLACEHOLDER_TOKEN])
    assert b.token_ids[row, :4].tolist() == [1, 2, 4, 9] and b.num_tokens[row] == 4
    # Its sample goes with the row.
    b.remove_request("a")
    assert "a" not in b.last_sampled

