"""``LLM``: the offline batch API of DESIGN.md §6.

It owns one ``EngineCore`` and drives its step loop until every request of a ``generate`` call
has finished. The executor is in-process (one worker, loaded by import path) until the Ray
controller takes over; nothing here touches a tensor.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pagedserve.config import EngineConfig, from_flat
from pagedserve.controller.engine_core import EngineCore
from pagedserve.controller.executor import LocalExecutor
from pagedserve.controller.launch import resolve_model_dir
from pagedserve.controller.tokenizer import load_tokenizer
from pagedserve.messages import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


class LLM:
    """Generate completions for batches of prompts.

    Keyword arguments are the flat engine options of ``EngineConfig`` (``block_size``,
    ``enable_prefix_caching``, ``max_model_len``, ``num_gpu_blocks``, ``kv_cache_memory_bytes``,
    ``max_num_seqs``, ...); unknown names raise ``ConfigError``.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        model_dir = resolve_model_dir(model)
        self.config: EngineConfig = from_flat(model=model_dir, **engine_options)
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or model_dir)
        self.engine = EngineCore(self.config, LocalExecutor(self.config), tokenizer=self.tokenizer)
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

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else (len(request_ids) > 8 and sys.stderr.isatty())
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
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

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
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
