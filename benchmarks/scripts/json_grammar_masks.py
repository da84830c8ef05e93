"""What the bounds of ``controller/json_grammar.py`` cost a token mask: the time llguidance
takes to compute one mask along a JSON document, under a schema of the conformance set,
compiled as llguidance does unbounded (``whitespace_flexible``) and as the controller does
(bounded whitespace runs and fraction digits), each alone and both, in alternating rounds.

    python benchmarks/scripts/json_grammar_masks.py                # SmolLM2's tokenizer
    python benchmarks/scripts/json_grammar_masks.py --rounds 10 --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent / "data" / "schemas.json"
# A document each schema validates: numbers with bounds, arrays of records, a plain object.
DOCUMENTS: dict[str, Any] = {
    "geo": {"city": "Paris", "lat": 48.8566, "lon": 2.3522},
    "ranges": {"voltage": 3.3, "current": -0.25, "count": 1000},
    "order": {"order_id": "ORD-123456", "items": [
        {"sku": "ABC123", "qty": 2, "price": 10.5},
        {"sku": "XYZ999", "qty": 1, "price": 3.25}], "paid": True},
    "person": {"name": "Ann", "age": 33},
}


def grammars(schema: dict[str, Any]) -> dict[str, str]:
    import llguidance

    from pagedserve.controller.json_grammar import WHITESPACE, bound_numbers

    text, bounded = json.dumps(schema), json.loads(json.dumps(schema))
    bound_numbers(bounded)
    build = llguidance.LLMatcher.grammar_from_json_schema
    flexible, pattern = {"whitespace_flexible": True}, {"whitespace_pattern": WHITESPACE}
    return {"unbounded": build(text, defaults=flexible),
            "whitespace": build(text, defaults=pattern),
            "digits": build(json.dumps(bounded), defaults=flexible),
            "both": build(json.dumps(bounded), defaults=pattern)}


def mask_times(ll_tokenizer: Any, grammar: str, tokens: list[int]) -> list[float]:
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - start)
        if not matcher.consume_token(token):
            raise RuntimeError(f"the document leaves the grammar: {matcher.get_error()}")
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)

    import llguidance.hf
    from transformers import AutoTokenizer

    from pagedserve.builder import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(args.model or str(resolve_model_dir(None)))
    ll_tokenizer = llguidance.hf.from_tokenizer(tok)
    entries = {e["name"]: e["schema"] for e in json.loads(SCHEMAS.read_text())}
    print("| schema | document | unbounded | whitespace | digits | both |")
    print("|---|---|---:|---:|---:|---:|")
    for name, doc in DOCUMENTS.items():
        compiled = grammars(entries[name])
        for indent, layout in ((None, "one line"), (2, "indented")):
            tokens = tok.encode(json.dumps(doc, indent=indent), add_special_tokens=False)
            times: dict[str, list[float]] = {k: [] for k in compiled}
            for _ in range(args.rounds):
                for kind, grammar in compiled.items():
                    times[kind] += mask_times(ll_tokenizer, grammar, tokens)
            cells = " | ".join(f"{1e6 * statistics.median(t):.1f}" for t in times.values())
            print(f"| {name} | {layout}, {len(tokens)} tokens | {cells} |")
    print("median microseconds per mask")
    return 0


if __name__ == "__main__":
    sys.exit(main())
