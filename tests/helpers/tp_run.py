"""One TP Worker rank over gloo: ``python tp_run.py RANK WORLD PORTFILE CKPT OUT PROMPTS SETUPS``.

Rendezvous as the Ray executor would do it: rank 0 opens the store on a free port and
publishes the port (here through PORTFILE); the other ranks join with it. Every rank drives
the same deterministic ``Stepper`` (so every rank sees identical ``SchedulerOutput``s) once
per ``(dcp, interleave)`` setup; rank 0 writes the greedy outputs of each setup to OUT.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from stepper import Stepper, layout_for  # tests/helpers is this script's directory

from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.workers.worker import Worker

BLOCK = 4


def join(worker: Worker, rank: int, port_file: Path) -> None:
    if rank == 0:
        port = worker.open_store("127.0.0.1")
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(port_file)
        worker.init_distributed()
        return
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published its store port")
        time.sleep(0.05)
    worker.init_distributed("127.0.0.1", int(port_file.read_text()))


def run_one(rank, world, port_file, ckpt, prompts, dcp, interleave):
    cfg = EngineConfig(
        model=ModelConfig(model=ckpt, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 24),
        parallel=ParallelConfig(
            tensor_parallel_size=world, decode_context_parallel_size=dcp, dcp_interleave=interleave
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    worker = Worker(cfg, rank)
    if not torch.distributed.is_initialized():
        join(worker, rank, port_file)
    else:
        worker.init_distributed()  # already joined: only forms the DCP groups
    report = worker.load_model()
    layout = layout_for(report, num_blocks=64, block_size=BLOCK)
    worker.init_kv_cache(layout)
    st = Stepper(worker, layout, seed=3, cp_size=dcp)
    for i, p in enumerate(prompts):
        st.add(f"r{i}", p, 8)
    return worker, report, st.run(budget=16)


def main(rank, world, port_file, ckpt, out, prompts, setups) -> None:
    results = []
    worker = None
    for dcp, interleave in setups:
        worker, report, outputs = run_one(rank, world, port_file, ckpt, prompts, dcp, interleave)
        results.append(
            {"outputs": outputs, "kv_heads_per_rank": report.layer_specs[0].num_kv_heads}
        )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if worker is not None:
        worker.shutdown()


if __name__ == "__main__":
    r, w, port_file, ckpt, out, prompts, setups = sys.argv[1:8]
    main(int(r), int(w), Path(port_file), ckpt, out, json.loads(prompts), json.loads(setups))
