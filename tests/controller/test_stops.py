"""Stop conditions: stop tokens, EOS, ignore_eos, min_tokens, max_tokens, max_model_len, stop
strings on the incrementally detokenized text."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from pagedserve.messages import SamplingParams

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(params=[1, 4], ids=["1-pass", "4-passes"])
def kit(kit, request):
    """Every test here with one decode pass per step, and with four: the controller then
    drops what the workers sampled after a stop they do not see (EOS here, stop strings)."""
    make = functools.partial(kit.make_engine, num_scheduler_steps=request.param)
    return SimpleNamespace(**{**vars(kit), "make_engine": make})


def run_scripted(kit, script, params, *, eos=(), tokenizer=None, max_model_len=None, vocab=1000):
    fake = kit.FakeExecutor(vocab_size=vocab, script={"r": script})
    eng = kit.make_engine(
        executor=fake, eos_token_ids=eos, tokenizer=tokenizer, max_model_len=max_model_len
    )
    eng.add_request("r", PROMPT, params)
    out = kit.run(eng)["r"].outputs[0]
    kit.assert_idle(eng)
    return out


def test_stop_token_id(kit):
    out = run_scripted(kit, [5, 6, 7, 8], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    assert out.token_ids == [5, 6, 7]
    assert (out.finish_reason, out.stop_reason) == ("stop", 7)


def test_eos_and_ignore_eos(kit):
    out = run_scripted(kit, [5, 8, 9, 10], SamplingParams(max_tokens=3), eos=[8])
    assert out.token_ids == [5, 8]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = run_scripted(kit, [5, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True), eos=[8])
    assert out.token_ids == [5, 8, 9]
    assert out.finish_reason == "length"


def test_min_tokens_defers_every_stop(kit):
    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7])
    out = run_scripted(kit, [8, 7, 8, 9], params, eos=[8])
    # Two tokens must come before any stop; the third (EOS) may stop.
    assert out.token_ids == [8, 7, 8]
    assert out.finish_reason == "stop"


def test_max_tokens(kit):
    out = run_scripted(kit, list(range(100, 120)), SamplingParams(max_tokens=4))
    assert out.token_ids == [100, 101, 102, 103]
    assert out.finish_reason == "length"


def test_max_model_len_caps_the_sequence(kit):
    out = run_scripted(kit, list(range(100, 120)), SamplingParams(max_tokens=None), max_model_len=9)
    assert len(PROMPT) + len(out.token_ids) == 9
    assert out.finish_reason == "length"


def test_prompt_of_exactly_max_model_len_gets_one_token(kit):
    fake = kit.FakeExecutor()
    eng = kit.make_engine(executor=fake, max_model_len=8)
    eng.add_request("r", list(range(1, 9)), SamplingParams(max_tokens=5))
    out = kit.run(eng)["r"].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    kit.assert_idle(eng)


def test_stop_string_is_cut_and_not_returned(kit, byte_tokenizer):
    tok = byte_tokenizer
    script = tok.encode("héllo wörld STOP and more text") + tok.encode(" tail" * 5)
    params = SamplingParams(max_tokens=60, stop=["STOP", "never"])
    out = run_scripted(kit, script, params, tokenizer=tok, vocab=len(tok.hf))
    assert out.text == "héllo wörld "
    assert (out.finish_reason, out.stop_reason) == ("stop", "STOP")
    # Generation stopped at the token that completed the stop string.
    assert "STOP" in tok.decode(out.token_ids) and "STOP" not in tok.decode(out.token_ids[:-1])


def test_stop_string_spanning_multibyte_tokens(kit, byte_tokenizer):
    tok = byte_tokenizer
    script = tok.encode("abc 😀x tail tail tail")
    out = run_scripted(
        kit, script, SamplingParams(max_tokens=40, stop=["😀x"]), tokenizer=tok, vocab=len(tok.hf)
    )
    assert out.text == "abc "
    assert out.stop_reason == "😀x"


def test_min_tokens_defers_stop_strings(kit, byte_tokenizer):
    tok = byte_tokenizer
    script = tok.encode("STOP then STOP end")
    n_first = len(tok.encode("STOP"))
    params = SamplingParams(max_tokens=40, stop=["STOP"], min_tokens=n_first)
    out = run_scripted(kit, script, params, tokenizer=tok, vocab=len(tok.hf))
    assert out.text == "STOP then "


def test_eos_text_not_in_output(kit, byte_tokenizer):
    tok = byte_tokenizer
    eos = tok.hf.eos_token_id
    script = tok.encode("fin 😀") + [eos, *tok.encode("after")]
    out = run_scripted(
        kit,
        script,
        SamplingParams(max_tokens=40, skip_special_tokens=False),
        tokenizer=tok,
        vocab=len(tok.hf),
        eos=tok.eos_token_ids,
    )
    assert out.text == "fin 😀"
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"


# ----------------------------------------------------------------- many stop strings (#27)


def _brute_find(stops, text, new_chars):
    """Every stop's every occurrence ending in the new characters; the first-starting one,
    ties to the one listed first."""
    best = None
    for rank, s in enumerate(stops):
        for start in range(len(text) - len(s) + 1):
            end = start + len(s)
            if end > len(text) - new_chars and text[start:end] == s:
                if best is None or (start, rank) < best[:2]:
                    best = (start, rank, s)
    return None if best is None else (best[0], best[2])


def test_stop_strings_find_what_a_scan_of_every_stop_finds():
    import random

    from pagedserve.controller.stop_strings import StopStrings

    rng = random.Random(27)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 12)))
        new = rng.randint(1, len(text))
        assert StopStrings(stops).find(text, new) == _brute_find(stops, text, new), (
            stops, text, new)


class _CountedStops(tuple):
    """A stop list that counts the passes made over it."""

    def __iter__(self):
        self.passes = getattr(self, "passes", 0) + 1
        return super().__iter__()


def test_ten_thousand_stop_strings_cost_nothing_per_step(kit, byte_tokenizer):
    """#27 row 6: 10,000 stop strings with n=128 ran 9x slower, and slowed everyone else,
    because every sequence scanned every stop string at every token. Now the list is passed
    over a fixed number of times per request (validation, one index), whatever the length."""
    import random

    tok = byte_tokenizer
    rng = random.Random(6)
    stops = _CountedStops(
        "".join(rng.choice("qzjxk") for _ in range(rng.randint(4, 9))) for _ in range(10_000)
    )
    n, max_tokens = 8, 48

    def run(stop):
        eng = kit.make_engine(executor=kit.FakeExecutor(vocab_size=len(tok.hf)), tokenizer=tok,
                              num_gpu_blocks=512)
        eng.add_request("r", tok.encode("hello"), SamplingParams(
            n=n, max_tokens=max_tokens, ignore_eos=True, seed=1, stop=stop))
        out = kit.run(eng)["r"].outputs
        kit.assert_idle(eng)
        return out

    plain = run(())
    many = run(stops)
    assert [c.token_ids for c in many] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in many] == ["length"] * n
    assert sum(len(c.token_ids) for c in many) == n * max_tokens
    # One validation per SamplingParams (the request's and each sequence's copy) plus the
    # index; none per token (there were n * max_tokens = 384 of them).
    passes = stops.passes
    assert passes <= 2 * (n + 2), f"{passes} passes over the stop strings"


def test_a_stop_string_among_thousands_still_stops(kit, byte_tokenizer):
    tok = byte_tokenizer
    script = tok.encode("one two three four five")
    stops = [f"zz{i}" for i in range(5000)] + ["three", "e f"]
    out = run_scripted(kit, script, SamplingParams(max_tokens=40, stop=stops), tokenizer=tok,
                       vocab=len(tok.hf))
    assert out.text == "one two "
    assert (out.finish_reason, out.stop_reason) == ("stop", "three")
