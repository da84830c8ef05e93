"""Structured outputs: grammars compiled off the step path, one matcher per sequence, and the
token masks a step sends the workers, as bytes (the controller never touches a tensor).

llguidance does the grammar work: it takes JSON Schema, regular expressions, choices, Lark
and GBNF, needs no other package, and computes a mask without walking the whole vocabulary.

A request under a constraint waits here, outside the scheduler, until its grammar is
compiled, so neither the batch nor the step waits for it. Compiled grammars are cached by
their text: a request gets a copy of the cached matcher, advanced by its own tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

from pagedserve.controller.errors import InvalidGrammarError
from pagedserve.controller.grammar_matcher import GrammarCloser, SequenceGrammar
from pagedserve.controller.json_grammar import json_schema_grammar
from pagedserve.controller.outputs import RequestGroup, failed_delta
from pagedserve.controller.request import Request
from pagedserve.controller.scheduler import Scheduler
from pagedserve.controller.tokenizer import Tokenizer
from pagedserve.messages import RequestDelta, SchedulerOutput, StructuredOutputsParams

__all__ = ["GrammarGate", "admit_compiled", "grammar_text"]

_JSON_KINDS = ("json", "json_object")


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``spec``; raises ``InvalidGrammarError`` naming what is
    wrong (checked without the tokenizer, so admission never waits for one)."""
    import llguidance

    kind = spec.kind
    try:
        if kind in _JSON_KINDS:
            schema = spec.json if kind == "json" else '{"type": "object"}'
            grammar = json_schema_grammar(schema, compact=spec.disable_any_whitespace)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(spec.choice))
        else:
            grammar = llguidance.grammar_from(kind, getattr(spec, kind))  # type: ignore[arg-type]
    except Exception as exc:  # the GBNF and JSON front ends raise their own types
        raise InvalidGrammarError(f"structured_outputs.{kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidGrammarError(f"structured_outputs.{kind}: {error.strip()}")
    return grammar


class GrammarGate:
    """Holds constrained requests until their grammar is compiled, then hands them to the
    scheduler with a matcher per sampling sequence; builds each step's token masks.

    Compilation runs on one background thread. The llguidance tokenizer (slow to build from a
    large vocabulary) is made there on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int],
                 max_model_len: int, max_cached: int = 256) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._eos = sorted(eos_token_ids)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._closer: GrammarCloser | None = None
        self._cache: OrderedDict[str, cf.Future[Any]] = OrderedDict()
        self._max_cached = max_cached
        self._held: dict[str, tuple[cf.Future[Any], Request, list[Request]]] = {}

    # ------------------------------------------------------------------ compile
    def _compile(self, grammar: str) -> Any:
        import llguidance
        import llguidance.hf

        if self._ll_tokenizer is None:
            ll = llguidance.hf.from_tokenizer(
                self._tokenizer.hf, n_vocab=self._vocab_size, eos_token=self._eos or None)
            self._closer = GrammarCloser(ll.tokenize_bytes, self._eos[0] if self._eos else None,
                                         ll.vocab_size)
            self._ll_tokenizer = ll
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar)
        if matcher.is_error():
            raise InvalidGrammarError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def _compiled(self, grammar: str) -> cf.Future[Any]:
        with self._lock:
            fut = self._cache.get(grammar)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._cache[grammar] = self._pool.submit(self._compile, grammar)
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(grammar)
            return fut

    # ----------------------------------------------------------------- requests
    def hold(self, head: Request, seqs: list[Request], grammar: str) -> None:
        """Keep a request until its grammar (``grammar_text``'s) is compiled."""
        self._held[head.group_id] = (self._compiled(grammar), head, seqs)

    def drop(self, group_id: str) -> None:
        self._held.pop(group_id, None)

    def clear(self) -> None:
        self._held.clear()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release(self, wait_s: float = 0.0) -> list[tuple[Request, BaseException | None]]:
        """The held requests whose grammar is compiled (waiting up to ``wait_s`` for one),
        each with its sequences' matchers attached, or with the compilation's error."""
        if wait_s > 0 and self._held:
            cf.wait([f for f, _, _ in self._held.values()], wait_s, cf.FIRST_COMPLETED)
        ready = []
        for gid, (fut, head, seqs) in list(self._held.items()):
            if not fut.done():
                continue
            del self._held[gid]
            error = fut.exception()
            if error is None:
                template = fut.result()
                for seq in seqs:
                    seq.grammar = SequenceGrammar(template.deep_copy(), self._closer)
                    # A resumed sequence (``controller.resume``) has tokens already.
                    if not all(map(seq.grammar.accept, seq.output_token_ids)):
                        error = InvalidGrammarError("structured_outputs: the resumed tokens "
                                                    "do not follow the grammar")
            ready.append((head, error))
        return ready

    # --------------------------------------------------------------------- step
    def step_masks(self, requests: Mapping[str, Request],
                   so: SchedulerOutput) -> dict[str, bytes]:
        """The masks of the constrained requests that sample this step: those whose
        scheduled tokens reach the end of their known tokens and drafts. Each knows the
        tokens its sequence has left (``max_tokens``, the model's length), to close its
        grammar in time."""
        masks: dict[str, bytes] = {}
        for rid in so.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None or req.grammar is None:
                continue
            drafts = so.draft_token_ids.get(rid, [])
            if req.num_computed_tokens == req.num_tokens + len(drafts):
                masks[rid] = req.grammar.masks(drafts, req.tokens_left(self._max_model_len))
        return masks

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def admit_compiled(gate: GrammarGate, groups: dict[str, RequestGroup],
                   scheduler: Scheduler) -> list[RequestDelta]:
    """Schedule the constrained requests whose grammar is compiled (waiting briefly for one
    when nothing else runs); fail those whose grammar did not compile."""
    idle = gate.num_held and not scheduler.has_unfinished()
    deltas = []
    for head, error in gate.release(0.05 if idle else 0.0):
        group = groups.get(head.group_id)
        if group is None:
            continue  # aborted or failed while its grammar compiled
        if error is None:
            scheduler.add_request(head)
            continue
        del groups[head.group_id]
        deltas.append(failed_delta(group.request_id, [s.index for s in group.seqs],
                                   str(error), type(error).__name__))
    return deltas

