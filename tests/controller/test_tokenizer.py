"""Incremental detokenization never emits broken UTF-8; tokenizer loading finds EOS ids."""

from __future__ import annotations

import json

from pagedserve.controller.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXT = "héllo wörld 😀 naïve café — 日本語 🎉🎉 done"


def test_multibyte_characters_split_across_tokens(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode(TEXT)
    # The fixture is byte level: some prefixes decode to a dangling U+FFFD.
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    prompt = tok.encode("prompt: ")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.output_text
    assert "" in deltas  # something was held back while a character was incomplete


def test_detokenizer_window_is_bounded(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode(TEXT * 20)
    detok = IncrementalDetokenizer(tok, [])
    for t in ids:
        detok.step([t])
    assert detok.output_text == TEXT * 20
    assert len(detok._ids) < 60


def test_flush_releases_incomplete_tail(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok, [])
    for t in ids[:-1]:
        detok.step([t])
    assert detok.output_text == "ok "
    detok.flush()
    assert detok.output_text.startswith("ok ") and len(detok.output_text) > 3


def test_skip_special_tokens(byte_tokenizer):
    tok = byte_tokenizer
    eos = tok.hf.eos_token_id
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert detok.step(tok.encode("hi")) == "hi"
    assert detok.step([eos]) == ""
    assert tok.eos_token_ids == frozenset({eos})


def test_load_tokenizer_reads_generation_config(byte_tokenizer, tmp_path):
    byte_tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, Tokenizer)
    assert loaded.eos_token_ids == {7, 9, byte_tokenizer.hf.eos_token_id}
    ids = byte_tokenizer.encode(TEXT)
    assert loaded.encode(TEXT) == ids
    eos = byte_tokenizer.hf.eos_token_id
    for skip in (True, False):
        for part in (ids, [*ids[:5], eos, *ids[5:9]], ids[1:4]):
            assert loaded.decode(part, skip) == loaded.hf.decode(part, skip_special_tokens=skip)
    assert load_tokenizer(str(tmp_path / "missing")) is None
    assert load_tokenizer("") is None
