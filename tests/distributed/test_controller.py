"""The Ray path end to end: ``LLM`` -> controller actor -> worker actor, over ZeroMQ.

One Ray instance and one ``LLM`` (tp=1, Ray backend) for the whole module; the tests run in
file order and the last one kills the controller (a new one takes over its streams) and shuts
the engine down, so it must stay last.
"""

from __future__ import annotations

import queue
import random
import time

import pytest
import ray
from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint
from helpers.sinks import add

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.remote_client import RemoteEngineClient
from pagedserve.cluster.router import Router
from pagedserve.controller.errors import InvalidTokenError, PromptTooLongError

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def llm(ckpt, ray_local):
    engine = None
    try:
        engine = LLM(str(ckpt), backend="ray", max_model_len=128, num_gpu_blocks=64)
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lens]


def _finals(q: queue.SimpleQueue, n: int, timeout_s: float = 60.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < n:
        out = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if out.finished:
            got[out.request_id] = out
    return got


# Seeded sampling with penalties, and stop tokens that end some completions early: the Ray
# path schedules each step while the one before it runs (async scheduling), so a step may
# carry a placeholder for a token that the worker fills in, and a request that stops has one
# step too many scheduled.
SAMPLED = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=5, repetition_penalty=1.2,
                         frequency_penalty=0.3, ignore_eos=True, logprobs=1)


def test_ray_path_equals_local_and_transformers(llm, ckpt) -> None:
    assert isinstance(llm.client, Router) and isinstance(llm.client.replicas[0].client,
                                                         RemoteEngineClient)
    prompts = _prompts(1, (1, 5, 16, 17, 40))
    overlapped = llm.client.stats()["num_overlapped_steps"]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.client.stats()["num_overlapped_steps"] > overlapped
    sampled = llm.generate(prompts, SAMPLED, use_tqdm=False)
    stops = SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                           stop_token_ids=[o.outputs[0].token_ids[4] for o in sampled])
    stopped = llm.generate(prompts, stops, use_tqdm=False)
    local = LLM(str(ckpt), backend="local", max_model_len=128, num_gpu_blocks=64)
    try:
        theirs = [o.outputs[0].token_ids for o in local.generate(prompts, GREEDY, use_tqdm=False)]
        for mine, params in ((sampled, SAMPLED), (stopped, stops)):
            want = local.generate(prompts, params, use_tqdm=False)
            got = [(c.token_ids, c.finish_reason) for o in mine for c in o.outputs]
            assert got == [(c.token_ids, c.finish_reason) for o in want for c in o.outputs]
            # The logprobs, position by position (another thread count may move the last
            # digits).
            for a, b in zip(mine, want, strict=True):
                for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [],
                                strict=True):
                    assert x.keys() == y.keys()
                    assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-3)
    finally:
        local.shutdown()
    assert ours == theirs
    model = load_hf_model(ckpt)
    assert ours == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    # Text prompts travel too (tokenized on the client, detokenized by the controller).
    (out,) = llm.generate("hello world", GREEDY, use_tqdm=False)
    assert out.prompt == "hello world" and len(out.outputs[0].token_ids) == MAX_NEW
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_abort_over_the_wire_frees_blocks(llm) -> None:
    client = llm.client
    q: queue.SimpleQueue = queue.SimpleQueue()
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    add(client, "long", _prompts(2, (20,))[0], long, q.put)
    first = q.get(timeout=60)
    assert not first.finished and first.prompt_token_ids
    client.abort_request("long")
    out = _finals(q, 1)["long"]
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 100
    stats = client.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_bad_requests_raise_typed_errors_others_unaffected(llm) -> None:
    client = llm.client
    q: queue.SimpleQueue = queue.SimpleQueue()
    good = _prompts(3, (7,))[0]
    add(client, "good", good, GREEDY, q.put)
    with pytest.raises(PromptTooLongError):
        add(client, "too-long", [5] * 200, GREEDY, q.put)
    with pytest.raises(InvalidTokenError):
        add(client, "oov", [5, 10_000], GREEDY, q.put)
    out = _finals(q, 1)["good"]
    assert out.error is None and len(out.outputs[0].token_ids) == MAX_NEW
    (again,) = llm.generate([good], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert client.is_healthy()


def test_worker_death_costs_in_flight_requests_only_a_pause(llm) -> None:
    client = llm.client
    (worker,) = ray.get(client.replicas[0].actor.worker_actors.remote(), timeout=30)
    q: queue.SimpleQueue = queue.SimpleQueue()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    add(client, "victim", [11] * 20, long, q.put)
    assert not q.get(timeout=60).finished
    ray.kill(worker, no_restart=True)
    out = _finals(q, 1)["victim"]
    # The controller rebuilt its worker group and the request resumed on it.
    assert out.error is None and out.outputs[0].finish_reason == "length"
    model = load_hf_model(llm.config.model.model)
    assert out.outputs[0].token_ids == hf_greedy(model, [11] * 20, 40)
    assert client.is_healthy() and client.stats()["num_worker_restarts"] == 1
    prompt = _prompts(4, (9,))[0]
    (again,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == hf_greedy(model, prompt, MAX_NEW)
    (new_worker,) = ray.get(client.replicas[0].actor.worker_actors.remote(), timeout=30)
    assert new_worker != worker


def test_a_killed_controller_is_replaced_and_its_streams_go_on(llm) -> None:
    # Must stay the last test of the module: it kills the module's controller.
    client = llm.client
    replica = client.replicas[0]
    actor = replica.actor
    workers = ray.get(actor.worker_actors.remote(), timeout=30)
    assert workers, "the controller should run its model on worker actors"
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=100, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    prompts = _prompts(5, (6, 20))
    cases = [(p, sp) for p in prompts for sp in (greedy, seeded)]
    reference = [o.outputs[0].token_ids for o in llm.generate(
        [p for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)]
    q: queue.SimpleQueue = queue.SimpleQueue()
    progress: dict[str, int] = {}

    def sink(out) -> None:
        progress[out.request_id] = len(out.outputs[0].token_ids)
        q.put(out)

    for i, (p, sp) in enumerate(cases):
        add(client, f"s{i}", p, sp, sink)
    deadline = time.monotonic() + 60
    while len(progress) < len(cases) or min(progress.values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    at_kill = dict(progress)
    ray.kill(actor, no_restart=True)
    finals = _finals(q, len(cases))
    # Every stream paused and went on: no error, nothing twice, nothing missing, the tokens of
    # an uninterrupted run, greedy and seeded alike.
    for i in range(len(cases)):
        out = finals[f"s{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == reference[i], i
    assert min(at_kill.values()) < 100  # the kill landed mid-stream
    assert client.is_healthy() and replica.actor != actor
    stats = client.stats()
    assert stats["num_controller_restarts"] == 1 and stats["num_requests_moved"] >= 1
    for worker in workers:  # owned by the killed controller, so gone with it
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.ping.remote(), timeout=30)
    # The placement group outlived the controller (the new one's workers run in it) and is
    # released with the engine.
    llm.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {pg["state"] for pg in ray.util.placement_group_table().values()}
        if states <= {"REMOVED"}:
            break
        time.sleep(0.2)
    assert states <= {"REMOVED"}, states
