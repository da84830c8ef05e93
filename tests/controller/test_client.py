"""LocalEngineClient: the in-process EngineClient, over the fake executor of conftest."""

from __future__ import annotations

import threading

import pytest
from helpers.sinks import add

from pagedserve.controller.client import LocalEngineClient
from pagedserve.controller.errors import EmptyPromptError, EngineDeadError, EngineOverloadedError
from pagedserve.controller.loop import EngineLoop
from pagedserve.messages import RequestOutput, SamplingParams


class Collector:
    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set()


def test_requests_stream_to_their_sinks(kit) -> None:
    client = LocalEngineClient(EngineLoop(kit.make_engine().core), "fake")
    try:
        sinks = [Collector() for _ in range(3)]
        for i, sink in enumerate(sinks):
            add(client, 
                f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), sink
            )
        for sink in sinks:
            assert sink.done.wait(10)
            final = sink.outputs[-1]
            assert len(final.outputs[0].token_ids) == 4 and final.outputs[0].finish_reason
            # Cumulative outputs: each one extends the last.
            lens = [len(o.outputs[0].token_ids) for o in sink.outputs]
            assert lens == sorted(lens)
        assert client.stats()["num_running"] == 0
    finally:
        client.shutdown()


def test_bad_request_raises_and_others_continue(kit) -> None:
    client = LocalEngineClient(EngineLoop(kit.make_engine().core), "fake")
    try:
        with pytest.raises(EmptyPromptError):
            add(client, "bad", [], SamplingParams(), Collector())
        ok = Collector()
        add(client, "ok", [9, 9], SamplingParams(max_tokens=2, ignore_eos=True), ok)
        assert ok.done.wait(10)
    finally:
        client.shutdown()


def test_abort_finishes_with_abort_and_frees_blocks(kit) -> None:
    client = LocalEngineClient(EngineLoop(kit.make_engine().core), "fake")
    try:
        sink = Collector()
        add(client, "long", [3] * 20, SamplingParams(max_tokens=200,
                                                            ignore_eos=True), sink)
        client.abort_request("long")
        assert sink.done.wait(10)
        assert sink.outputs[-1].outputs[0].finish_reason == "abort"
        assert client.stats()["kv_blocks_used"] == 0
    finally:
        client.shutdown()


def test_dead_engine_fails_requests_and_refuses_new_ones(kit) -> None:
    engine = kit.make_engine()
    client = LocalEngineClient(EngineLoop(engine.core), "fake")
    try:
        def boom(_):
            raise RuntimeError("worker exploded")

        engine.executor.execute = boom
        sink = Collector()
        add(client, "r", [4, 4], SamplingParams(max_tokens=3, ignore_eos=True), sink)
        assert sink.done.wait(10)
        assert sink.outputs[-1].error and "worker exploded" in sink.outputs[-1].error
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError):
            add(client, "r2", [4], SamplingParams(), Collector())
    finally:
        client.shutdown()


def test_the_loop_is_bounded_and_refuses_adds_beyond_it(kit) -> None:
    engine = kit.make_engine(max_pending_requests=2)
    client = LocalEngineClient(EngineLoop(engine.core), "fake")
    try:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        sinks = [Collector(), Collector()]
        add(client, "a", [3] * 4, long, sinks[0])
        add(client, "b", [4] * 4, long, sinks[1])
        with pytest.raises(EngineOverloadedError, match="max_pending_requests"):
            add(client, "c", [5] * 4, long, Collector())
        client.abort_request("a")  # aborts always pass, and free a place
        assert sinks[0].done.wait(10)
        ok = Collector()
        add(client, "c", [5] * 4, SamplingParams(max_tokens=2, ignore_eos=True), ok)
        assert ok.done.wait(10)
    finally:
        client.shutdown()


def test_the_loop_checks_the_kv_manager_once_per_idle_spell(kit) -> None:
    import time

    engine = kit.make_engine()
    client = LocalEngineClient(EngineLoop(engine.core), "fake")

    def after_idle_check(checks: int) -> dict:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = client.stats()
            if stats["kv_integrity_checks"] > checks and stats["num_running"] == 0:
                return stats
            time.sleep(0.01)
        raise AssertionError("no idle check ran")

    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        first = Collector()
        add(client, "a", [3, 4, 5], params, first)
        assert first.done.wait(10)
        stats = after_idle_check(0)
        assert stats["kv_integrity_ok"] == 1
        checks = stats["kv_integrity_checks"]
        # A block that never comes back: the next idle check reports it.
        leaked = engine.kv.pool.get_new_blocks(1)
        second = Collector()
        add(client, "b", [6, 7], params, second)
        assert second.done.wait(10)
        stats = after_idle_check(checks)
        assert stats["kv_integrity_ok"] == 0
        assert stats["kv_integrity_checks"] == checks + 1  # once per idle spell, not per poll
        # A request done in the step that admits it (one token) ends an idle spell too.
        engine.kv.pool.free_blocks(leaked)
        third = Collector()
        add(client, "c", [8, 9], SamplingParams(max_tokens=1, ignore_eos=True), third)
        assert third.done.wait(10)
        stats = after_idle_check(checks + 1)
        assert stats["kv_integrity_ok"] == 1
    finally:
        client.shutdown()


def test_a_factory_is_built_and_stepped_on_the_loop_thread(kit) -> None:
    """Given a factory, the loop's own thread builds the core and runs every step: one thread
    does all of an in-process engine's torch work (two threads running OpenMP regions make
    each op cost 2-3x on this project's CPU hosts)."""
    threads: list[threading.Thread] = []

    def build():
        threads.append(threading.current_thread())
        core = kit.make_engine().core
        step = core.step

        def stepped():
            threads.append(threading.current_thread())
            return step()

        core.step = stepped
        return core

    client = LocalEngineClient(EngineLoop(build), "fake")
    try:
        sink = Collector()
        add(client, "r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), sink)
        assert sink.done.wait(10)
        assert len(sink.outputs[-1].outputs[0].token_ids) == 3
        assert threads[0] is not threading.current_thread()
        assert len(threads) >= 4 and all(t is threads[0] for t in threads)
        assert client.is_healthy()
    finally:
        client.shutdown()


def test_a_factory_that_fails_raises_from_the_constructor() -> None:
    def build():
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        EngineLoop(build)
