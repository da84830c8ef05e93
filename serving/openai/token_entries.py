"""What one sampled position shows a client: a token's text and its logprob entries."""

from __future__ import annotations

from pagedserve.controller.client import EngineClient

__all__ = ["token_text", "top_entries"]

# JSON has no -inf: the lowest logprob an answer shows (as vLLM clamps it).
_MIN_LOGPROB = -9999.0


def token_text(client: EngineClient, token_id: int) -> str:
    tok = client.tokenizer
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)


def top_entries(entry: dict[int, float], num: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(sampled id, its logprob, the ``num`` most likely alternatives) of one position.

    The engine's dict holds the sampled token first, then the top candidates."""
    sampled = next(iter(entry))
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:num]
    return sampled, max(entry[sampled], _MIN_LOGPROB), [
        (t, max(lp, _MIN_LOGPROB)) for t, lp in top
    ]
