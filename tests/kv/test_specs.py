from __future__ import annotations

import dataclasses
import math

import pytest

from pagedserve.kv import (
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheManager,
    SlidingWindowSpec,
    group_layer_specs,
    max_concurrency,
    num_blocks_from_bytes,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
SW = SlidingWindowSpec(
    block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2, sliding_window=1024
)


def test_page_and_worst_case_bytes() -> None:
    assert FULL.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536
    assert FULL.max_blocks_per_request(2048) == 128
    assert FULL.max_memory_usage_bytes(2050) == 129 * 65536
    # sliding: min(ceil(L/B), ceil((W-1)/B) + 1)
    assert SW.max_blocks_per_request(8192) == math.ceil(1023 / 16) + 1 == 65
    assert SW.max_blocks_per_request(100) == 7
    assert SW.page_size_bytes == FULL.page_size_bytes


def test_specs_are_frozen_and_validated() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.block_size = 32  # type: ignore[misc]
    with pytest.raises(InvalidArgumentError):
        FullAttentionSpec(0, 1, 1, 1)
    with pytest.raises(InvalidArgumentError):
        SlidingWindowSpec(16, 1, 1, 1, sliding_window=0)


def test_ten_full_twenty_sliding_make_three_groups_of_ten() -> None:
    layers: dict[str, FullAttentionSpec | SlidingWindowSpec] = {}
    f = s = 0
    for i in range(30):  # a Gemma-like 2:1 interleave: s, s, f, s, s, f, ...
        if i % 3 == 2:
            layers[f"f{f}"] = FULL
            f += 1
        else:
            layers[f"s{s}"] = SW
            s += 1
    groups = group_layer_specs(layers)
    assert [len(g.layer_names) for g in groups] == [10, 10, 10]
    assert [type(g.spec) for g in groups] == [
        FullAttentionSpec,
        SlidingWindowSpec,
        SlidingWindowSpec,
    ]
    assert groups[0].layer_names == tuple(f"f{i}" for i in range(10))
    # Strided split of the sliding bucket.
    assert groups[1].layer_names == tuple(f"s{i}" for i in range(0, 20, 2))
    assert groups[2].layer_names == tuple(f"s{i}" for i in range(1, 20, 2))
    # num_blocks = bytes // page // layers_per_group
    assert num_blocks_from_bytes(10 * 65536 * 1000 + 5, groups) == 1000
    # concurrency: (N-1) usable blocks / blocks one max-length request holds over all groups
    assert max_concurrency(1001, groups, 2048) == pytest.approx(1000 / (128 + 65 + 65))
    m = KVCacheManager([g.spec for g in groups], 1001, 16, 2048)
    assert m.num_groups == 3


def test_uniform_and_uneven_grouping() -> None:
    groups = group_layer_specs({f"l{i}": FULL for i in range(4)})
    assert len(groups) == 1 and len(groups[0].layer_names) == 4
    assert num_blocks_from_bytes(4 * 65536 * 10, groups) == 10
    assert max_concurrency(128 * 2 + 1, groups, 2048) == 2.0
    uneven = group_layer_specs(
        {**{f"f{i}": FULL for i in range(2)}, **{f"s{i}": SW for i in range(5)}}
    )
    assert [len(g.layer_names) for g in uneven] == [2, 2, 2, 1]
    assert num_blocks_from_bytes(2 * 65536 * 7, uneven) == 7
    assert group_layer_specs({}) == [] and num_blocks_from_bytes(123, []) == 1


def test_mismatched_page_sizes_are_rejected() -> None:
    small = SlidingWindowSpec(16, 4, 128, 2, sliding_window=64)
    with pytest.raises(InvalidArgumentError):
        group_layer_specs({"a": FULL, "b": small})
