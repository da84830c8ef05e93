"""A stream carries every delta to its end, whatever the timing of the engine's outputs.

A scripted client delivers the deltas exactly when the test says: all of them before the
stream's first read, or the final one while the handler is writing the previous event. Either
way the stream must carry all the text and end each choice with its ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from pagedserve.messages import AddRequest, CompletionDelta, RequestDelta
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.openai.api_errors import APIError
from pagedserve.serving.openai.endpoint import Endpoint
from pagedserve.serving.openai.engine_run import EngineRun, Prompt, ServerContext
from pagedserve.serving.openai.metrics import ServerMetrics

Sink = Callable[[RequestDelta], None]


class ScriptedClient:
    """An ``EngineClient`` whose deltas the test sends through ``deliver``."""

    model_name = "scripted"
    tokenizer = None
    error = None

    def __init__(self, at_submit: list[RequestDelta] | None = None) -> None:
        self.at_submit = at_submit or []
        self.sinks: dict[str, Sink] = {}
        self.aborted: list[str] = []

    def submit(self, request: AddRequest, sink: Sink) -> Future[None]:
        self.sinks[request.request_id] = sink
        for delta in self.at_submit:  # on the caller's thread, before any read
            sink(delta)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def deliver(self, delta: RequestDelta) -> None:
        self.sinks[delta.request_id](delta)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_healthy(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}


def _delta(text: str, finish: str | None = None, error: str | None = None) -> RequestDelta:
    return RequestDelta(
        "r", [CompletionDelta(0, [1], text, finish_reason=finish)],
        finished=finish is not None, error=error,
    )


async def _endpoint(client: ScriptedClient, chat: bool = False) -> Endpoint:
    ctx = ServerContext(client, ServerMetrics(client))  # type: ignore[arg-type]
    run = EngineRun(ctx, "r", [Prompt("p", [5])], SamplingParams(max_tokens=4), None)
    await run.start()
    return Endpoint(chat=chat, client=client, run=run, request_id="r",  # type: ignore[arg-type]
                    model="scripted", stream=True, include_usage=False, top_n=None)


def _parse(events: list[str]) -> tuple[str, list[str | None], bool]:
    """(all text, the finish reasons seen, whether [DONE] closed it) of a completions stream."""
    text, reasons, done = "", [], False
    for ev in events:
        payload = ev.removeprefix("data: ").strip()
        if payload == "[DONE]":
            done = True
            continue
        body = json.loads(payload)
        assert "error" not in body, body
        for choice in body["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content", "")
            if choice["finish_reason"] is not None:
                reasons.append(choice["finish_reason"])
    return text, reasons, done


@pytest.mark.parametrize("chat", [False, True])
def test_every_delta_arrives_before_the_first_read(chat: bool) -> None:
    async def main() -> list[str]:
        client = ScriptedClient([_delta("a"), _delta("b"), _delta("c", "length")])
        endpoint = await _endpoint(client, chat)
        await asyncio.sleep(0)  # the sink's hops onto the loop run now
        assert endpoint.run.finished
        return [ev async for ev in endpoint.stream_events()]

    text, reasons, done = _parse(asyncio.run(main()))
    assert (text, reasons, done) == ("abc", ["length"], True)


@pytest.mark.parametrize("chat", [False, True])
def test_final_delta_lands_while_an_event_is_written(chat: bool) -> None:
    async def main() -> list[str]:
        client = ScriptedClient()
        endpoint = await _endpoint(client, chat)
        events: list[str] = []
        client.deliver(_delta("x"))
        async for ev in endpoint.stream_events():
            events.append(ev)
            if '"x"' in ev:
                # The handler is writing this event: the rest of the request, its end
                # included, arrives before the stream is read again.
                client.deliver(_delta("y"))
                client.deliver(_delta("z", "stop"))
                await asyncio.sleep(0)
                assert endpoint.run.finished
        return events

    text, reasons, done = _parse(asyncio.run(main()))
    assert (text, reasons, done) == ("xyz", ["stop"], True)


def _logged_under(caplog: pytest.LogCaptureFixture, message: str) -> str:
    """The request id the engine's error text was logged under (a 500 shows only the id)."""
    ids = [r.args[0] for r in caplog.records if isinstance(r.args, tuple) and r.args
           and message in r.getMessage()]
    assert ids, f"{message!r} was not logged"
    return str(ids[0])


def test_an_error_before_the_first_read_ends_the_stream_with_its_error_event(caplog) -> None:
    async def main() -> list[str]:
        client = ScriptedClient([_delta("a"), _delta("", "error", error="rank 0 died")])
        endpoint = await _endpoint(client)
        await asyncio.sleep(0)
        return [ev async for ev in endpoint.stream_events()]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    request_id = _logged_under(caplog, "rank 0 died")
    message = json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    assert message == f"internal error (request id {request_id})"


def test_a_non_streamed_wait_still_raises_a_late_error(caplog) -> None:
    async def main() -> None:
        client = ScriptedClient([_delta("a"), _delta("", "error", error="boom")])
        endpoint = await _endpoint(client)
        await asyncio.sleep(0)
        await endpoint.run.wait()

    with pytest.raises(APIError, match="internal error") as info:
        asyncio.run(main())
    assert info.value.status == 500
    assert info.value.message == f"internal error (request id {_logged_under(caplog, 'boom')})"
