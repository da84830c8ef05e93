"""One TP rank scoring prompts: ``python tp_prompt_logprobs.py RANK WORLD PORTFILE CKPT OUT
PROMPTS``. Every rank drives the same ``Stepper`` with chunked prefills and prompt logprobs
asked for; each rank writes what its ``ModelRunnerOutput``s reported to ``OUT.RANK``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stepper import Stepper, layout_for  # tests/helpers is this script's directory
from tp_run import BLOCK, join

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.messages import SamplingParams
from pagedserve.workers.worker import Worker


def main(rank: int, world: int, port_file: Path, ckpt: str, out: str, prompts: list) -> None:
    cfg = EngineConfig(
        model=ModelConfig(model=ckpt, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 24),
        parallel=ParallelConfig(tensor_parallel_size=world),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    worker = Worker(cfg, rank)
    join(worker, rank, port_file)
    report = worker.load_model()
    layout = layout_for(report, num_blocks=64, block_size=BLOCK)
    worker.init_kv_cache(layout)
    st = Stepper(worker, layout, seed=3)
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=i + 1)
        st.add(f"r{i}", p, 2, sp)
    st.add("plain", prompts[0][:5], 2)
    st.run(budget=6)
    reported = [out.prompt_logprobs for out in st.outputs if out.prompt_logprobs]
    Path(f"{out}.{rank}").write_text(json.dumps(reported))
    worker.shutdown()


if __name__ == "__main__":
    r, w, port_file, ckpt, out, prompts = sys.argv[1:7]
    main(int(r), int(w), Path(port_file), ckpt, out, json.loads(prompts))
