"""``LLM``: the offline Python API.

Two backends (``backend=``, default ``$PAGEDSERVE_BACKEND`` or ``ray``), one path: both run the
engine loop behind an ``EngineClient`` and ``generate`` pipelines every prompt's add, then
collects the final outputs that the accumulators build from the deltas.

- ``ray``: a local Ray instance starts (or ``ray_address``, e.g. ``"auto"``, attaches), with
  controller actor(s) and their workers;
- ``local``: the engine loop on a thread of this process, no Ray (for tests and debugging;
  ``llm.engine`` is the core).

Nothing here touches a tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from pagedserve.builder import resolve_backend, resolve_model_dir, start_engine
from pagedserve.config import EngineConfig, from_flat
from pagedserve.controller.client import EngineClient, LocalEngineClient
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.errors import EngineDeadError, RequestFailedError
from pagedserve.controller.outputs import final_output_sink
from pagedserve.messages import AddRequest, RequestOutput, SamplingParams, StructuredOutputsParams
from pagedserve.serving.chat import Conversation, chat_prompts
from pagedserve.serving.tool_plan import ToolChoiceError, plan_tools

logger = logging.getLogger(__name__)

# Text, token ids, or {"prompt_token_ids": [...], "prompt": text (optional)} as vLLM takes.
PromptType = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Generate completions for batches of prompts, or replies to conversations (``chat``).

    ``model`` is a Hugging Face checkpoint directory, a ``.gguf`` file (or a folder holding
    one; converted once into the user cache), ``"demo"`` for the random demo checkpoint, or
    None for the default real model, SmolLM2-135M-Instruct.
    Keyword arguments are the flat engine options of ``EngineConfig`` (``block_size``,
    ``enable_prefix_caching``, ``max_model_len``, ``num_gpu_blocks``, ``kv_cache_memory_bytes``,
    ``kv_cache_dtype`` (``auto`` | ``bfloat16`` | ``fp8_e4m3``), ``max_num_seqs``,
    ``tensor_parallel_size``, ``data_parallel_size``, ``ray_address``, ...);
    unknown names raise ``ConfigError``. ``backend`` is ``ray`` or ``local`` (see the module
    docstring).
    """

    def __init__(
        self, model: str | None = None, *, backend: str | None = None, **engine_options: Any
    ) -> None:
        model_dir = resolve_model_dir(model)
        self.config: EngineConfig = from_flat(model=model_dir, **engine_options)
        self.backend = resolve_backend(self.config, backend)
        self.client: EngineClient | None = start_engine(self.config, backend=self.backend)
        self.tokenizer = self.client.tokenizer
        self._ids = itertools.count()
        self._told_unread = False  # chat's ``auto`` without a parser is logged once, not per call

    @property
    def engine(self) -> EngineCore:
        """The in-process engine core (local backend only)."""
        if not isinstance(self.client, LocalEngineClient):
            raise RuntimeError("the engine core lives in this process only with backend='local'")
        return self.client.engine  # type: ignore[no-any-return]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        A prompt is text or a list of token ids. If any request is refused (too long, empty,
        invalid token ids), the requests of this call already added are aborted and the typed
        error propagates: nothing stays queued behind a failed call. So does a request the
        engine failed while serving it: ``RequestFailedError`` when it failed alone (the
        engine serves on), ``EngineDeadError`` when the engine did.
        """
        client = self._client()
        batch = _as_batch(prompts)
        params = _as_params(sampling_params, len(batch))
        done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        request_ids: list[str] = []
        pending: list[Future[None]] = []
        try:
            for prompt, sp in zip(batch, params, strict=True):
                text, token_ids = self._encode(prompt)
                add = AddRequest(f"llm-{next(self._ids)}", token_ids, sp, text, cache_salt,
                                 final_only=True)
                pending.append(client.submit(add, final_output_sink(add, done.put)))
                request_ids.append(add.request_id)
            for fut in pending:
                client.wait_added(fut)
        except BaseException:
            for request_id in request_ids:
                client.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids), use_tqdm)
        try:
            while len(finished) < len(request_ids):
                try:
                    out = done.get(timeout=1.0)
                except queue.Empty:
                    if not client.is_healthy():
                        raise EngineDeadError("the engine stopped before finishing") from None
                    continue
                if out.error is not None:
                    alone = out.error_code == RequestFailedError.__name__
                    raise (RequestFailedError if alone else EngineDeadError)(
                        f"request {out.request_id} failed: {out.error}")
                finished[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in finished:
                    client.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tool_call_parser: str | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        to a list of them, each rendered through the model's chat template (or
        ``chat_template``); one output per conversation, in order. Raises ``ChatError``.
        Messages take the shapes of the server's chat completions: an assistant's
        ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``,
        content None or text), a ``tool`` result with its ``tool_call_id``, content as text or
        a list of text parts; so a call and its result go back for the next turn.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` definitions) reach the
        template, and ``tool_choice`` (``none``, ``auto`` (the default), ``required`` or
        ``{"type": "function", "function": {"name": ...}}``) acts as on the server's chat
        completions: ``required`` and a named function constrain the output so that the
        arguments follow the function's schema (the sampling params must then set no
        ``structured_outputs`` of their own); ``auto`` reads the calls the model writes with
        ``tool_call_parser`` (None: the format the template shows; with neither, as in vLLM's
        ``chat``, the tools are only rendered and ``tool_calls`` stays None, logged once).
        Each completion's ``tool_calls`` lists the calls found. Raises ``ToolChoiceError`` for
        tools it cannot serve."""
        template = chat_template or (self.tokenizer.chat_template if self.tokenizer else None)
        plan = plan_tools(tools, tool_choice, parser=tool_call_parser, chat_template=template,
                          parallel_tool_calls=parallel_tool_calls, require_parser=False)
        if plan.unread is not None and not self._told_unread:
            self._told_unread = True
            logger.info("%s", plan.unread)
        prompts = chat_prompts(
            self.tokenizer, messages, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs,
            tools=plan.tools,
        )
        if plan.constraint is not None:
            sampling_params = [_constrained(sp, plan.constraint)
                               for sp in _as_params(sampling_params, len(prompts))]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)
        if plan.fmt is not None:
            for out in outs:
                for comp in out.outputs:
                    comp.tool_calls = plan.calls(comp.text)
        return outs

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):  # already rendered: the ids as they are
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _client(self) -> EngineClient:
        if self.client is None:
            raise RuntimeError("this LLM was shut down")
        return self.client

    @property
    def vocab_size(self) -> int:
        return self._client().vocab_size

    @property
    def max_model_len(self) -> int:
        return self._client().max_model_len

    def stats(self) -> dict[str, Any]:
        return self._client().stats()

    def shutdown(self) -> None:
        """Stop the engine (and, on the Ray path, its controller actors and workers). The Ray
        instance itself stays up, for the next ``LLM`` of this process. Idempotent."""
        if self.client is not None:
            self.client.shutdown()
            self.client = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _progress_bar(total: int, use_tqdm: bool | None) -> Any:
    show = use_tqdm if use_tqdm is not None else (total > 8 and sys.stderr.isatty())
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)


def _constrained(sp: SamplingParams, constraint: StructuredOutputsParams) -> SamplingParams:
    if sp.structured_outputs is not None:
        raise ToolChoiceError("tool_choice required or a named function sets the output's "
                              "constraint: the sampling params may not set structured_outputs",
                              "tool_choice")
    return dataclasses.replace(sp, structured_outputs=constraint)


def _as_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
