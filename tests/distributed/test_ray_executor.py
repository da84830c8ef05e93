"""The Ray worker group on one local Ray instance: tensor-parallel parity through ``RayExecutor``
+ ``EngineCore``, fault handling (a killed rank is named, the group is rebuilt and the in-flight
requests resume on it, restarts are capped), and placement errors.

One Ray instance (conftest.py's, shared by the directory) serves the module; every executor is
shut down in a finalizer.
"""

from __future__ import annotations

import functools
import socket
import time
from pathlib import Path

import pytest
import ray
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint
from helpers.driver import drive
from helpers.engine_run import generate
from helpers.ray_group import ray_executor
from ray.util.placement_group import placement_group_table

from pagedserve.builder import make_executor
from pagedserve.cluster.placement import (
    PlacementTimeoutError,
    missing_resources,
    rank_order,
)
from pagedserve.cluster.ray_executor import RayExecutor
from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import EngineDeadError, RequestFailedError
from pagedserve.controller.executor import LocalExecutor, WorkerGroupError
from pagedserve.controller.restarts import RestartPolicy
from pagedserve.messages import SamplingParams
from pagedserve.workers.cpu_process import usable_cpus
from pagedserve.workers.ray_worker import controller_reachable

MAX_NEW = 16
PROMPTS = [[1, 17, 99, 4, 250, 31, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3], [42]]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@functools.cache
def _checkpoint(root: str, kind: str, kv_heads: int) -> Path:
    return make_checkpoint(kind, Path(root) / f"{kind}-kv{kv_heads}", num_key_value_heads=kv_heads)


@functools.cache
def _reference(path: Path) -> list[list[int]]:
    model = load_hf_model(path)
    return [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


def _config(path: Path, tp: int = 1, strategy: str = "PACK") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
        parallel=ParallelConfig(tensor_parallel_size=tp, placement_strategy=strategy),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )


def _ray_engine(request, config: EngineConfig, **engine_kwargs) -> EngineCore:
    executor = ray_executor(config, ready_timeout_s=120, step_timeout_s=60)
    request.addfinalizer(executor.shutdown)
    return drive(EngineCore(config, executor, eos_token_ids=(), **engine_kwargs))


def _generate(engine: EngineCore, prompts=PROMPTS, prefix: str = "r") -> list[list[int]]:
    return generate(engine, prompts, GREEDY, prefix)


# ---------------------------------------------------------------- pure placement helpers


def test_rank_order_puts_the_controller_node_first_and_keeps_nodes_contiguous():
    table = {0: "b", 1: "a", 2: "ctl", 3: "b", 4: "ctl", 5: "a"}
    slots = rank_order(table, controller_node="ctl")
    assert [(s.rank, s.bundle_index, s.node_id) for s in slots] == [
        (0, 2, "ctl"),
        (1, 4, "ctl"),
        (2, 0, "b"),
        (3, 3, "b"),
        (4, 1, "a"),
        (5, 5, "a"),
    ]
    # The controller's node holds no bundle: nodes in order of their first bundle.
    assert [s.bundle_index for s in rank_order({0: "x", 1: "y"}, "ctl")] == [0, 1]


def test_missing_resources_names_what_the_cluster_lacks():
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert missing_resources([{"GPU": 1.0}] * 2, "PACK", nodes) == {
        "GPU": "need 2 in total, the cluster has 0"
    }
    assert "largest has 2" in missing_resources([{"CPU": 1.0}] * 3, "STRICT_PACK", nodes)["CPU"]
    assert missing_resources([{"CPU": 1.0}] * 3, "PACK", nodes) == {}


def test_controller_probe():
    srv = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    assert controller_reachable(endpoint)
    srv.close()
    assert not controller_reachable(endpoint, timeout_s=1.0)


def test_make_executor_backends(tmp_path):
    cfg = _config(tmp_path, tp=1)
    assert isinstance(make_executor(cfg, "local"), LocalExecutor)
    assert isinstance(make_executor(cfg, "ray", placement_group=object()), RayExecutor)
    with pytest.raises(ValueError, match="needs the worker group's placement group"):
        make_executor(cfg, "ray")
    with pytest.raises(ValueError, match="the config has 2 ranks"):
        make_executor(_config(tmp_path, tp=2), "local")
    with pytest.raises(ValueError, match="unknown executor"):
        make_executor(cfg, "mpi")


# ---------------------------------------------------------------- on Ray


def test_unsatisfiable_placement_fails_fast_and_names_the_missing_resources(ray_local, tmp_path):
    for bundle, tp, resource in (({"GPU": 1.0}, 2, "GPU"), (None, 100, "CPU")):
        start = time.monotonic()
        with pytest.raises(PlacementTimeoutError) as info:
            ray_executor(_config(tmp_path, tp=tp), placement_timeout_s=1.0, bundle=bundle)
        assert time.monotonic() - start < 10
        assert resource in info.value.missing and resource in str(info.value)
    # Nothing is left pending: the timed-out groups were removed.
    states = {g["state"] for g in placement_group_table().values()}
    assert "PENDING" not in states, states


def test_tp2_matches_tp1_and_transformers(ray_local, ckpt_root, request):
    path = _checkpoint(ckpt_root, "llama", 2)
    expected = _reference(path)
    cfg1 = _config(path, tp=1)
    tp1 = drive(EngineCore(cfg1, make_executor(cfg1), eos_token_ids=()))
    try:
        assert _generate(tp1) == expected
    finally:
        tp1.shutdown()
    engine = _ray_engine(request, _config(path, tp=2))
    assert _generate(engine) == expected
    table = engine.executor.rank_table
    assert [s.rank for s in table] == [0, 1]
    assert {s.node_id for s in table} == {ray.get_runtime_context().get_node_id()}
    # Ray starts a 1-CPU actor with one OpenMP thread; each rank takes half the machine instead.
    infos = ray.get([a.node_info.remote() for a in engine.executor._actors])
    assert [i["torch_threads"] for i in infos] == [max(1, usable_cpus() // 2)] * 2
    # The local instance starts its workers at normal priority (Ray's default is nice 15).
    assert [i["niceness"] for i in infos] == [0, 0]
    # A worker operation is the Worker's method alone: called on every rank by name, also while
    # the step loops run, and the steps go on after it.
    ranks = engine.executor.collective_rpc("rank_info")
    assert [(i["rank"], i["tp"]) for i in ranks] == [(0, [0, 2]), (1, [1, 2])]
    assert _generate(engine, PROMPTS[:1], prefix="after-rpc") == expected[:1]
    with pytest.raises(WorkerGroupError, match="no_such_operation"):
        engine.executor.collective_rpc("no_such_operation")


def test_tp4_with_four_kv_heads(ray_local, ckpt_root, request):
    path = _checkpoint(ckpt_root, "llama", 4)
    engine = _ray_engine(request, _config(path, tp=4))
    assert engine.worker_report.layer_specs[0].num_kv_heads == 1  # 4 KV heads over 4 ranks
    assert _generate(engine) == _reference(path)


def test_a_request_every_rank_rejects_fails_alone(ray_local, ckpt_root, request):
    """A prompt token past the vocabulary (the controller told a larger one, so its check lets
    it through) is rejected by both ranks alike: over the wire, that request fails with a typed
    error, the others produce what they produce alone, and the group is never rebuilt."""
    path = _checkpoint(ckpt_root, "llama", 2)
    expected = _reference(path)
    engine = _ray_engine(request, _config(path, tp=2))
    vocab = engine.vocab_size
    engine.vocab_size = vocab + 100
    engine.add_request("bad", [1, 17, vocab + 3, 4], GREEDY)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.vocab_size = vocab
    done = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "generation did not finish"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["bad"].error_code == RequestFailedError.__name__
    assert "vocabulary" in done["bad"].error
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert engine.num_restarts == 0 and engine.restarts.recent_failures == 0 and engine.healthy
    assert _generate(engine, PROMPTS[:1], prefix="after") == expected[:1]


def _process_gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its parent: either way it runs no more code."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _kill_and_wait(actor, timeout_s: float = 10.0) -> None:
    """Kill a rank and wait until its process has stopped. Ray marks the actor dead (its
    methods raise) before the process is gone, and a rank whose process lingers can still
    answer a step over the step channel, which does not go through Ray."""
    pid = ray.get(actor.ping.remote(), timeout=10)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while not _process_gone(pid):
        assert time.monotonic() < deadline, "the killed rank is still running"
        time.sleep(0.05)


def test_killed_rank_is_named_requests_resume_then_restarts_are_capped(
    ray_local, ckpt_root, request
):
    path = _checkpoint(ckpt_root, "llama", 2)
    expected = _reference(path)
    model = load_hf_model(path)
    long_ref = [hf_greedy(model, p, 3 * MAX_NEW) for p in PROMPTS]
    policy = RestartPolicy(max_restarts=1, backoff_s=0.1)
    engine = _ray_engine(request, _config(path, tp=2), restarts=policy)
    executor: RayExecutor = engine.executor  # type: ignore[assignment]
    long = SamplingParams(max_tokens=3 * MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"long{i}", p, long)
    for _ in range(5):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    victim = executor.rank_table[1]

    # 1. Kill rank 1 mid-generation: the failure is found promptly and names the rank; the
    #    requests go back to the waiting queue, with no error, on a fresh KV manager.
    _kill_and_wait(executor.worker_actors()[1])
    start = time.monotonic()
    assert engine.step() == []
    assert time.monotonic() - start < 5.0
    err = engine.last_failure
    assert isinstance(err, WorkerGroupError) and (err.rank, err.node_id) == (1, victim.node_id)
    assert f"rank 1 on node {victim.node_id}" in str(err)
    assert len(engine.scheduler.waiting) == 3 and engine.kv.usage == 0.0

    # 2. The next step rebuilds the group; the requests finish with the tokens of an
    #    uninterrupted run, and new ones get the right tokens too.
    done = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the resumed requests did not finish"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(o.error is None for o in done.values())
    assert [done[f"long{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == long_ref
    assert engine.stats()["kv_blocks_used"] == 0
    assert _generate(engine, prefix="after") == expected
    assert engine.num_restarts == 1 and engine.healthy
    new_actors = executor.worker_actors()
    assert len(new_actors) == 2 and executor.check_failure() is None

    # 3. A rank dies while the engine is idle: the monitor finds it, and with the restart
    #    budget spent the engine reports itself dead.
    ray.kill(new_actors[0], no_restart=True)
    deadline = time.monotonic() + 15
    while executor.check_failure() is None:
        assert time.monotonic() < deadline, "the monitor did not notice the dead rank"
        time.sleep(0.1)
    assert executor.check_failure().rank == 0
    assert engine.step() == []  # nothing in flight; the failure is recorded
    assert not engine.healthy
    with pytest.raises(EngineDeadError, match="at most 1 restarts"):
        engine.step()


def test_worker_exits_when_the_controller_socket_vanishes(ray_local, tmp_path):
    from pagedserve.cluster.wire import StepChannel
    from pagedserve.workers.ray_worker import RayWorker

    actor = RayWorker.options(num_cpus=0).remote(_config(tmp_path, tp=1), 0)
    chan = StepChannel(1, host=ray.util.get_node_ip_address())
    try:
        loop = actor.run.remote(chan.endpoints, 0, True, 0.2, 0.5)
        chan.wait_ready(timeout_s=60)
    finally:
        chan.close()  # no stop message: as if the controller process had died
    done, _ = ray.wait([loop], timeout=20)
    assert done, "the rank did not notice that its controller is gone"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ping.remote(), timeout=20)


DRIVER = """
import os, sys, time, ray
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedserve.builder import make_executor
from pagedserve.cluster.placement import reserve_worker_group
ray.init(address=sys.argv[1], log_to_driver=False)
cfg = EngineConfig(model=ModelConfig(model=sys.argv[2], dtype="float32"),
                   cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 22),
                   parallel=ParallelConfig(tensor_parallel_size=1))
ex = make_executor(cfg, "ray", reserve_worker_group(1, "PACK", 30))
ex.initialize()
pids = ray.get([a.ping.remote() for a in ex.worker_actors()], timeout=30)
print("PIDS", *pids, flush=True)
time.sleep(120)
"""


def test_no_orphan_workers_when_the_controller_is_killed(ray_local, ckpt_root, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    path = _checkpoint(ckpt_root, "llama", 2)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(script), address, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        pids: list[int] = []
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while not pids and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("PIDS"):
                pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 1, "the driver did not start its worker group"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, f"workers {pids} outlived their controller"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
