"""Structured outputs across swap preemption, in-process on a tiny random Llama: constrained
requests are swapped to the host tier mid-generation and back, and every output still follows
its schema (checked with ``jsonschema``) and equals, token for token, what the same requests
give on an engine large enough never to preempt. A matcher that lost or repeated a token on
the way out or back in would mask the wrong tokens and break either check."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers.checkpoints import make_checkpoint
from helpers.schemas import BOUNDED_SCHEMAS

from pagedserve import LLM, SamplingParams
from pagedserve.messages import StructuredOutputsParams as Constraint

SCHEMAS = BOUNDED_SCHEMAS[:3]
ENGINE = {"backend": "local", "block_size": 4, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", Path(tmp_path_factory.mktemp("so-swap")) / "llama")


def _workload() -> tuple[list[list[int]], list[SamplingParams], list[dict]]:
    prompts, params, schemas = [], [], []
    for i in range(8):
        schema = SCHEMAS[i % len(SCHEMAS)]
        # Greedy and seeded sampling alike: both must come out the same after a swap.
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i}
        params.append(SamplingParams(max_tokens=64, structured_outputs=Constraint(
            json=schema, disable_any_whitespace=True), **sampling))
        prompts.append([(7 * i + j) % 500 + 3 for j in range(10 + 3 * i)])
        schemas.append(schema)
    return prompts, params, schemas


def _generate(checkpoint: Path, **options) -> tuple[list[list[int]], list[str], dict]:
    prompts, params, _ = _workload()
    llm = LLM(str(checkpoint), **ENGINE, **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    comps = [o.outputs[0] for o in outs]
    assert all(c.finish_reason == "stop" for c in comps), [c.text for c in comps]
    return [list(c.token_ids) for c in comps], [c.text for c in comps], stats


def test_constraints_hold_across_swap_preemption(checkpoint: Path) -> None:
    ref_ids, ref_texts, ref_stats = _generate(checkpoint, num_gpu_blocks=256)
    assert ref_stats["num_preemptions"] == 0
    # 8 requests of up to ~60 tokens need ~90 blocks of 4 at once; 30 forces preemptions,
    # and the host tier is large enough that every one of them is a swap.
    ids, texts, stats = _generate(checkpoint, num_gpu_blocks=30, max_num_batched_tokens=24,
                                  preemption_mode="swap", num_host_blocks=128)
    assert stats["num_preemptions"] > 0 and stats["kv_host_swap_fallbacks"] == 0
    assert stats["kv_host_swap_outs"] == stats["kv_host_swap_ins"] == stats["num_preemptions"]
    _, _, schemas = _workload()
    for text, schema in zip(texts, schemas, strict=True):
        jsonschema.validate(json.loads(text), schema)
    assert ids == ref_ids and texts == ref_texts
    # The mask time the engine reports (benchmarks/scripts/structured_throughput.py reads it).
    for st in (ref_stats, stats):
        assert 0 < st["num_grammar_mask_steps"] <= st["num_steps"]
        assert 0 < st["time_grammar_mask_s"] < st["time_schedule_s"]
