"""Speculative decoding with a draft model: a random draft (the target's weights, perturbed)
proposes on the workers, and greedy output stays transformers' greedy of the target token for
token; every draft is the draft model's own greedy continuation of the request's tokens (its
KV, kept in the target's blocks, stays right through rejections, preemption, prefix hits and
forks); the KV plan pays for the draft's layers; bad configurations are refused by name.

Each generating case asserts that drafts were both accepted and rejected.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from helpers.checkpoints import (
    hf_greedy,
    load_hf_model,
    make_checkpoint,
    perturbed_copy,
    repeating_prompts,
)

from pagedserve import LLM, SamplingParams
from pagedserve.config import ConfigError, EngineConfig, from_flat
from pagedserve.controller.drafts.model import ModelDrafts
from pagedserve.controller.kv_plan import plan_kv_cache
from pagedserve.messages import LayerKVSpec, WorkerReport

MAX_NEW = 40
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Perturbation of the draft's weights (the target's are drawn with std 0.05): enough to make
# the draft wrong now and then, little enough that it is mostly right.
DRAFT_NOISE = 0.004


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


@functools.cache
def _target(kind: str, root: str) -> Path:
    # init_std=0.05 makes these models loop over phrases of their own, which a close draft
    # predicts more often than not.
    return make_checkpoint(kind, Path(root) / kind, init_std=0.05)


@functools.cache
def _draft(kind: str, root: str, noise: float = DRAFT_NOISE) -> Path:
    return perturbed_copy(_target(kind, root), Path(root) / f"{kind}-draft-{noise}", noise)


@functools.cache
def _greedy(path: str, prompts: tuple[tuple[int, ...], ...], n: int = MAX_NEW) -> list[list[int]]:
    model = load_hf_model(path)
    return [hf_greedy(model, list(p), n) for p in prompts]


def _spec(draft: Path, k: int, **more: object) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **more}


def _run(path: Path, prompts: list[list[int]], params=GREEDY, *, record=False, **options):
    """Generate; with ``record``, also every draft list the workers sent, with the number of
    tokens of its request it follows: ``[(request id, num_tokens, drafts)]``."""
    llm = LLM(str(path), backend="local", **options)
    received: list[tuple[str, int, list[int]]] = []
    try:
        if record:
            proposer = llm.engine.drafter.proposer
            assert isinstance(proposer, ModelDrafts)
            receive = proposer.receive

            def spy(request_id: str, num_tokens: int, drafts: list[int]) -> None:
                received.append((request_id, num_tokens, list(drafts)))
                receive(request_id, num_tokens, drafts)

            proposer.receive = spy  # type: ignore[method-assign]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.stats(), received
    finally:
        llm.shutdown()


def _assert_speculated(stats: dict) -> None:
    """Drafts were proposed, some accepted and some rejected, and every block came back."""
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("k", "block_size"), [(1, 16), (3, 4), (3, 16)])
def test_greedy_equals_transformers(k: int, block_size: int, ckpt_root: str) -> None:
    path, draft = _target("llama", ckpt_root), _draft("llama", ckpt_root)
    prompts = repeating_prompts(1)
    outs, stats, _ = _run(path, prompts, block_size=block_size,
                          speculative_config=_spec(draft, k))
    assert _tokens(outs) == _greedy(str(path), tuple(map(tuple, prompts)))
    _assert_speculated(stats)


def test_the_target_as_its_own_draft_is_always_right(ckpt_root: str) -> None:
    """Its KV is the target's at every position, so every draft is accepted: one wrong
    position of the draft's KV would show as a rejection."""
    path = _target("llama", ckpt_root)
    prompts = repeating_prompts(1)
    outs, stats, _ = _run(path, prompts, block_size=4, speculative_config=_spec(path, 3))
    assert _tokens(outs) == _greedy(str(path), tuple(map(tuple, prompts)))
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_drafts_are_the_draft_models_greedy_through_preemption_and_prefix_hits(
    preemption: str, ckpt_root: str,
) -> None:
    """A hybrid target (sliding-window and full-attention groups), prompts sharing a prefix,
    and a pool so small that requests are preempted while they draft (recomputed, or swapped
    to the host tier and back): the output is the target's greedy, and every draft list the
    workers sent is exactly the draft model's own greedy continuation (transformers) of the
    tokens it follows."""
    path, draft = _target("hybrid", ckpt_root), _draft("hybrid", ckpt_root)
    shared = repeating_prompts(7, (40,))[0]
    prompts = [shared + p for p in repeating_prompts(2, (3, 9, 20))]
    prompts += repeating_prompts(3, (50, 64))
    swap = {"preemption_mode": "swap", "num_host_blocks": 64} if preemption == "swap" else {}
    outs, stats, received = _run(path, prompts, record=True, num_gpu_blocks=20, block_size=16,
                                 speculative_config=_spec(draft, 3), **swap)
    expected = _greedy(str(path), tuple(map(tuple, prompts)))
    assert _tokens(outs) == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if preemption == "swap":
        assert stats["kv_host_swap_ins"] > 0
    _assert_speculated(stats)
    model = load_hf_model(draft)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    assert received
    for rid, num_tokens, drafts in received:
        context = full[rid.rsplit(":", 1)[-1]][:num_tokens]  # the engine's id is client:id
        assert drafts == _argmax_run(model, context, len(drafts)), (rid, num_tokens)


def _argmax_run(model, context: list[int], n: int) -> list[int]:  # noqa: ANN001
    """Greedy continuation by full forward passes (no generate() overhead: many short runs)."""
    import torch

    ids = list(context)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context):]


def test_n_and_seeded_sampling_draw_what_they_draw_without_drafts(ckpt_root: str) -> None:
    """Forked completions share their prompt's blocks (and so the draft's KV, copied on
    write). Seeded samples take their noise from (seed, position), so with or without a draft
    model the same tokens come out; the draft proposes greedily, which keeps verification
    exact for sampling too."""
    path, draft = _target("qwen2", ckpt_root), _draft("qwen2", ckpt_root)
    prompts = repeating_prompts(5, (12, 30))
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, top_k=20, seed=11,
                            ignore_eos=True)
    base, _, _ = _run(path, prompts, params)
    outs, stats, _ = _run(path, prompts, params, speculative_config=_spec(draft, 2))
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    assert tokens == [[c.token_ids for c in o.outputs] for o in base]
    _assert_speculated(stats)


def test_backs_off_at_batch_size(ckpt_root: str) -> None:
    path, draft = _target("llama", ckpt_root), _draft("llama", ckpt_root)
    prompts = repeating_prompts(1)
    outs, stats, received = _run(path, prompts, record=True,
                                 speculative_config=_spec(draft, 3, disable_by_batch_size=1))
    assert _tokens(outs) == _greedy(str(path), tuple(map(tuple, prompts)))
    assert stats["spec_decode_num_draft_tokens"] == 0
    # The workers drafted once, after the first step (nothing ran when it was scheduled), and
    # never again.
    lengths = {len(p) + 1 for p in prompts}
    assert received and all(n in lengths for _, n, _ in received)


# ----------------------------------------------------------------------- the KV plan


def _report(num_layers: int, draft_layers: int, kv_bytes: int) -> WorkerReport:
    spec = LayerKVSpec(num_kv_heads=2, head_size=16, dtype_bytes=4)
    return WorkerReport([spec] * num_layers, kv_bytes, 512, 512, "cpu",
                        draft_layer_specs=[spec] * draft_layers)


def test_kv_plan_counts_the_draft_layers() -> None:
    """Every block costs the draft's layers too: 2 target layers and 1 draft layer of 2 KV
    heads x 16 dims x 4 bytes x 2 (K, V) x 16 tokens = 2048 bytes per layer and block."""
    page = 2 * 16 * 2 * 16 * 4
    budget = 1_000_000
    config = from_flat(block_size=16, host_kv_cache_bytes=500_000)
    plain = plan_kv_cache(config, _report(2, 0, budget), 512)
    drafted = plan_kv_cache(config, _report(2, 1, budget), 512)
    assert plain.layout.num_blocks == budget // (2 * page)
    assert drafted.layout.num_blocks == budget // (3 * page)
    assert drafted.layout.num_host_blocks == 500_000 // (3 * page)
    assert drafted.layout.draft_groups == [0] and plain.layout.draft_groups == []
    assert drafted.draft_block_bytes == page


def test_draft_layers_read_a_group_that_keeps_their_tokens() -> None:
    """A full-attention draft layer needs a full-attention target group; a sliding one the
    narrowest group at least as wide, a full one first."""
    full = LayerKVSpec(2, 16, 4)
    wide, narrow = LayerKVSpec(2, 16, 4, 64), LayerKVSpec(2, 16, 4, 8)
    config = from_flat(block_size=16)

    def groups_for(target: list[LayerKVSpec], draft: list[LayerKVSpec]) -> list[int]:
        report = WorkerReport(target, 1 << 20, 512, 512, "cpu", draft_layer_specs=draft)
        return plan_kv_cache(config, report, 512).layout.draft_groups

    assert groups_for([full, narrow, full, narrow], [narrow, full]) == [0, 0]
    assert groups_for([wide, narrow], [narrow, LayerKVSpec(2, 16, 4, 32)]) == [1, 0]
    with pytest.raises(ConfigError, match="speculative_config.model"):
        groups_for([narrow, narrow], [full])


def test_the_engine_sizes_its_pool_for_the_draft(ckpt_root: str) -> None:
    """A draft of another shape (one layer, one KV head of 16 dims, half the target's page)
    costs its own bytes per block, and it serves."""
    path = _target("llama", ckpt_root)
    small = make_checkpoint("llama", Path(ckpt_root) / "llama-small", init_std=0.05,
                            num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1)
    budget = 1 << 20
    page = 2 * 16 * 2 * 16 * 4  # K and V of 16 tokens x 2 KV heads x 16 dims, float32
    blocks = {}
    prompts = repeating_prompts(1, (17,))
    for name, spec in (("plain", None), ("draft", _spec(small, 2))):
        outs, stats, _ = _run(path, prompts, block_size=16, kv_cache_memory_bytes=budget,
                              speculative_config=spec)
        blocks[name] = stats["kv_blocks_total"] + 1  # and the null block
        assert _tokens(outs) == _greedy(str(path), tuple(map(tuple, prompts)))
        assert budget - (2 * page + page // 2) < stats["kv_cache_bytes"] <= budget
    assert blocks["plain"] == budget // (2 * page)
    assert blocks["draft"] == budget // (2 * page + page // 2)


# --------------------------------------------------------------------- configuration


def test_configuration_errors_name_the_field(ckpt_root: str) -> None:
    path = _target("llama", ckpt_root)
    with pytest.raises(ConfigError, match="speculative_config.model"):
        from_flat(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="speculative_config.model"):
        from_flat(speculative_config={"method": "ngram", "model": str(path)})
    with pytest.raises(ConfigError, match="speculative_config.method.*decode_context"):
        from_flat(tensor_parallel_size=2, decode_context_parallel_size=2,
                  speculative_config=_spec(path, 2))
    assert isinstance(from_flat(speculative_config=_spec(path, 2)), EngineConfig)


@pytest.mark.parametrize(("what", "overrides", "options", "message"), [
    ("vocab", {"vocab_size": 256}, {}, "vocabulary of 256 tokens, the target 512"),
    ("positions", {"max_position_embeddings": 64}, {}, "covers 64 positions.*max_model_len=512"),
    ("missing", None, {}, "cannot load the draft model"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(
    what: str, overrides: dict | None, options: dict, message: str, ckpt_root: str,
) -> None:
    path = _target("llama", ckpt_root)
    draft = Path(ckpt_root) / f"bad-{what}"
    if overrides is not None:
        make_checkpoint("llama", draft, init_std=0.05, **overrides)
    with pytest.raises(ConfigError, match="speculative_config.model") as info:
        LLM(str(path), backend="local", speculative_config=_spec(draft, 2), **options)
    assert info.match(message)


def test_a_shorter_draft_serves_a_shorter_max_model_len(ckpt_root: str) -> None:
    path = _target("llama", ckpt_root)
    draft = make_checkpoint("llama", Path(ckpt_root) / "short", init_std=0.05,
                            max_position_embeddings=128)
    prompts = repeating_prompts(1, (20,))
    outs, _, _ = _run(path, prompts, max_model_len=128, speculative_config=_spec(draft, 2))
    assert _tokens(outs) == _greedy(str(path), tuple(map(tuple, prompts)))
