"""What one request may cost the server: ``ServerLimits``, one frozen object given to
``build_app`` (``pagedserve serve`` fills it from its ``--max-*`` and ``--*-timeout`` flags).

A request over a limit is refused with a 4xx naming the limit and the flag that raises it,
before the work it would cause: the body size while the body is read (413), the prompt's
characters before it is tokenized, the stop strings and the response's logprob entries before
the engine sees the request (400).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ServerLimits"]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Limits and timeouts of the HTTP server. ``None`` where a limit allows it: unlimited."""

    max_body_bytes: int | None = 16 << 20
    """A request body's size (413 beyond it, as soon as Content-Length or the bytes read say
    so). 16 MiB holds a 1M-token prompt sent as token ids (about 7 MB of JSON) twice over;
    FastAPI parses a body with ``json.loads`` on the event loop, holding the GIL (about 17 ms
    per MiB of token ids on one core), so this also bounds the one stall left on the loop.
    ``/v1/files`` uploads have their own, larger limit."""
    max_prompt_chars: int | None = None
    """Characters in one prompt (a completion's prompt, a conversation's messages, a
    ``/tokenize`` text), checked before tokenizing. None: 32 per token of the model's context
    (``prompt_chars_for``), far above the 3-6 characters a token spans in real text, so any
    prompt that fits the context passes, and a 20 MB prompt costs nothing to refuse."""
    max_stop_strings: int | None = 64
    """Stop strings per request. OpenAI allows 4; 64 leaves room for eval harnesses."""
    max_stop_chars: int | None = 256
    """Characters in one stop string. A stream holds back the longest stop's length minus one
    characters until they cannot start a match, so long stops also delay the stream."""
    max_logprob_entries: int | None = 1 << 19
    """Logprob entries one response may carry: over its prompts and choices, (echoed prompt
    tokens + max_tokens) x (1 + logprobs). About 25 bytes of JSON each, so 524,288 is a
    ~13 MB answer (a 2,048-token echo with logprobs 20 and n 12); #27 measured a 9.8 KB
    request asking for a 115 MB one. Checked only when logprobs are asked for."""
    header_timeout_s: float | None = 30.0
    """From a connection's first byte (or its opening) to the end of the request's headers;
    past it the connection is closed with 408. Real clients send headers in milliseconds;
    this is what a slow-header (slowloris) client is allowed to hold a connection."""
    body_timeout_s: float | None = 60.0
    """From the end of the headers to the end of the body (408 past it): 16 MiB at 280 KB/s,
    a 200 MiB upload at 3.5 MB/s. A total, not a gap between reads, so a client dripping a
    byte at a time cannot hold the connection either."""
    write_timeout_s: float | None = 30.0
    """How long one write of a stream may wait for a client that stopped reading; past it the
    stream's engine requests are aborted and its unsent output dropped. A stalled reader
    otherwise keeps its requests running, counted in flight, their output piling up."""
    cpu_workers: int = 2
    """Threads for tokenizing, detokenizing and building responses off the event loop. The
    tokenizers run in Rust without the GIL, so more threads than cores only take CPU from the
    engine's own thread (vLLM's server uses one)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cpu_workers":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"cpu_workers must be an integer >= 1, got {value!r}")
            elif value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{f.name} must be positive or None, got {value!r}")

    def prompt_chars_for(self, max_model_len: int) -> int | None:
        """The prompt character limit for a model with this context length."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return _CHARS_PER_CONTEXT_TOKEN * max_model_len


# No tokenizer we know spans more than ~16 characters per token on average even for
# whitespace-heavy code; twice that never refuses a prompt the context could hold.
_CHARS_PER_CONTEXT_TOKEN = 32
