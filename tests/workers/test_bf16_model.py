"""A bfloat16 model against its float32 self on tiny random checkpoints, teacher-forced.

The float32 worker generates N greedy tokens; both workers then score prompt + those tokens
(prompt logprobs), so every position sees the same history and the difference is bf16's
rounding alone, not a diverged continuation. At each of the N positions the float32 top-1
token's log-probability under bf16 is within ``WORST_TOL`` of float32's, and within
``MEAN_TOL`` on average over the N positions.

The bounds are set by what bf16 itself costs, measured on these checkpoints (3 prompts each,
48 positions, mean top-1 logprob about -2.6): transformers' own bf16 run against its float32
one differs by 0.09-0.28 nats at worst and 0.023-0.043 on average; ours by 0.07-0.16 at worst
and 0.025-0.036 on average. The bounds leave about 2x on ours and admit transformers' own.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.messages import SamplingParams
from pagedserve.workers.worker import Worker

B = 4
N = 48  # generated positions compared
WORST_TOL = 0.3  # nats, at any one position
MEAN_TOL = 0.05  # nats, averaged over the N positions


def _worker(path, dtype: str, stepper_module):
    """A loaded worker and its KV layout (160 blocks of B)."""
    w = Worker(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype=dtype),
            cache=CacheConfig(block_size=B, kv_cache_memory_bytes=1 << 24),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        )
    )
    return w, stepper_module.layout_for(w.load_model(), num_blocks=160, block_size=B)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 16))] for _ in range(n)]


def _scored(worker: Worker, stepper_module, layout, seqs: list[list[int]]) -> list[list[float]]:
    """Per sequence, the log-probability of each token after the first, given those before."""
    st = stepper_module.Stepper(worker, layout, seed=3)
    for i, s in enumerate(seqs):
        st.add(f"s{i}", s, 1, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    st.run(budget=24)  # chunked: several steps per sequence, decodes beside prefills
    rows: dict[str, dict[int, float]] = {f"s{i}": {} for i in range(len(seqs))}
    for out in st.outputs:
        for rid, (first, _ids, lps) in (out.prompt_logprobs or {}).items():
            for j, lp in enumerate(lps):
                rows[rid][first + j] = lp[0]
    return [[rows[f"s{i}"][p] for p in range(1, len(s))] for i, s in enumerate(seqs)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_bf16_top1_logprobs_follow_float32(kind, checkpoint_dir, stepper_module) -> None:
    path = checkpoint_dir(kind)
    f32, layout = _worker(path, "float32", stepper_module)
    f32.init_kv_cache(layout)
    prompts = _prompts(3)
    gen = stepper_module.Stepper(f32, layout, seed=1)
    for i, p in enumerate(prompts):
        gen.add(f"g{i}", p, N)
    greedy = gen.run(budget=24)
    seqs = [p + greedy[f"g{i}"] for i, p in enumerate(prompts)]
    want = _scored(f32, stepper_module, layout, seqs)
    f32.shutdown()

    # "bfloat16" is honoured on every CPU, bf16 instructions or not.
    bf16, _ = _worker(path, "bfloat16", stepper_module)
    assert bf16.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    # Logits leave the bf16 LM head as float32: the sampler and the logprobs see float32.
    hidden = torch.randn(3, bf16.arch.hidden_size).to(torch.bfloat16)
    assert bf16.model.compute_logits(hidden).dtype == torch.float32
    bf16.init_kv_cache(layout)
    assert all(t.dtype == torch.bfloat16 for t in bf16.runner.kv_pool.tensors)
    got = _scored(bf16, stepper_module, layout, seqs)
    bf16.shutdown()
    for p, w, g in zip(prompts, want, got, strict=True):
        # The generated positions: the float32 top-1 token (greedy) at each of them.
        w_gen, g_gen = torch.tensor(w[len(p) - 1 :]), torch.tensor(g[len(p) - 1 :])
        assert len(w_gen) == N
        assert (w_gen <= 0).all() and torch.isfinite(g_gen).all()
        diff = (g_gen - w_gen).abs()
        worst, mean = diff.max().item(), diff.mean().item()
        assert worst <= WORST_TOL, f"{kind}: top-1 logprob off by {worst:.3f} nats"
        assert mean <= MEAN_TOL, f"{kind}: top-1 logprob off by {mean:.3f} nats on average"
        # bf16 changes them, a little: the comparison is not of float32 with itself.
        assert worst > 0
