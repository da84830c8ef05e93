"""``LLM``: the offline batch API of DESIGN.md §6.

Two backends (``backend=``, default ``$PAGEDSERVE_BACKEND`` or ``ray``):

- ``ray``: ``start_engine`` starts a local Ray instance (or attaches to ``ray_address``, e.g.
  ``"auto"``), launches the controller actor(s) and returns a client; ``generate`` sends every
  prompt (pipelined) and collects the final outputs the client streams back;
- ``local``: one ``EngineCore`` with an in-process worker, driven synchronously by
  ``generate`` (no threads, no Ray: for tests and debugging; ``llm.engine`` is the core).

Nothing here touches a tensor.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.config import EngineConfig, from_flat
from pagedserve.controller.chat import Conversation, chat_prompts
from pagedserve.controller.client import EngineClient, EngineDeadError
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import LocalExecutor
from pagedserve.controller.launch import resolve_backend, resolve_model_dir, start_engine
from pagedserve.controller.tokenizer import load_tokenizer
from pagedserve.messages import RequestOutput, SamplingParams

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
    ``max_num_seqs``, ``tensor_parallel_size``, ``data_parallel_size``, ``ray_address``, ...);
    unknown names raise ``ConfigError``. ``backend`` is ``ray`` or ``local`` (see the module
    docstring).
    """

    def __init__(
        self, model: str | None = None, *, backend: str | None = None, **engine_options: Any
    ) -> None:
        model_dir = resolve_model_dir(model)
        self.config: EngineConfig = from_flat(model=model_dir, **engine_options)
        self.backend = resolve_backend(self.config, backend)
        self.engine: EngineCore | None = None
        self.client: EngineClient | None = None
        if self.backend == "local":
            self.tokenizer = load_tokenizer(self.config.model.tokenizer or model_dir)
            self.engine = EngineCore(
                self.config, LocalExecutor(self.config), tokenizer=self.tokenizer
            )
        else:
            self.client = start_engine(self.config, backend=self.backend)
            self.tokenizer = self.client.tokenizer
        self._ids = itertools.count()

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
        error propagates: nothing stays queued behind a failed call.
        """
        batch = _as_batch(prompts)
        params = _as_params(sampling_params, len(batch))
        if self.client is not None:
            return self._generate_remote(self.client, batch, params, use_tqdm, cache_salt)
        assert self.engine is not None
        request_ids: list[str] = []
        try:
            for prompt, sp in zip(batch, params, strict=True):
                request_id = str(next(self._ids))
                text, token_ids = self._encode(prompt)
                self.engine.add_request(
                    request_id, token_ids, sp, prompt=text, cache_salt=cache_salt
                )
                request_ids.append(request_id)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

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
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        to a list of them, each rendered through the model's chat template (or
        ``chat_template``); one output per conversation, in order. Raises ``ChatError``."""
        prompts = chat_prompts(
            self.tokenizer, messages, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):  # already rendered: the ids as they are
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _generate_remote(
        self,
        client: EngineClient,
        batch: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool | None,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        """Send every prompt (pipelined when the client can), then collect the final outputs."""
        done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

        def sink(out: RequestOutput) -> None:
            if out.finished:
                done.put(out)

        request_ids: list[str] = []
        pending_adds = []
        submit = getattr(client, "add_request_async", None)
        try:
            for prompt, sp in zip(batch, params, strict=True):
                request_id = f"llm-{next(self._ids)}"
                text, token_ids = self._encode(prompt)
                if submit is not None:
                    pending_adds.append(
                        submit(request_id, token_ids, sp, sink, prompt=text, cache_salt=cache_salt)
                    )
                else:
                    client.add_request(
                        request_id, token_ids, sp, sink, prompt=text, cache_salt=cache_salt
                    )
                request_ids.append(request_id)
            for fut in pending_adds:
                client.wait_added(fut)  # type: ignore[attr-defined]
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
                    raise EngineDeadError(f"request {out.request_id} failed: {out.error}")
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

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        assert self.engine is not None
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids), use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]

    @property
    def vocab_size(self) -> int:
        source: Any = self.client if self.client is not None else self._engine()
        return int(source.vocab_size)

    @property
    def max_model_len(self) -> int:
        source: Any = self.client if self.client is not None else self._engine()
        return int(source.max_model_len)

    def _engine(self) -> EngineCore:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down")
        return self.engine

    def stats(self) -> dict[str, Any]:
        if self.client is not None:
            return self.client.stats()
        assert self.engine is not None
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine (and, on the Ray path, its controller actors and workers). The Ray
        instance itself stays up, for the next ``LLM`` of this process. Idempotent."""
        if self.client is not None:
            self.client.shutdown()
            self.client = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

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
