"""``pagedserve serve``'s API key from a file or the environment, not only from the flag
(which every local user can read in /proc/PID/cmdline)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

import pagedserve.serving.openai.server as server
from pagedserve.serving.cli.serve import add_serve_parser, run_serve


def _serve(monkeypatch, llama_dir: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    """Run ``serve`` up to the server start: (exit status, what the server got)."""
    seen: dict[str, Any] = {"key": "<not started>", "kw": {}}

    def fake_serve(config: Any, host: str, port: int, api_key: str | None = None,
                   **kw: Any) -> None:
        seen["key"], seen["kw"] = api_key, kw

    monkeypatch.setattr(server, "serve", fake_serve)
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", str(llama_dir), "--max-model-len", "128",
                              *flags])
    return run_serve(args), seen


def _serve_key(monkeypatch, llama_dir: Path, *flags: str) -> tuple[int, Any]:
    """(exit status, the key the server would have started with)."""
    status, seen = _serve(monkeypatch, llama_dir, *flags)
    return status, seen["key"]


def test_the_key_comes_from_a_file(monkeypatch, llama_dir, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret-from-file \nignored second line\n")
    assert _serve_key(monkeypatch, llama_dir, "--api-key-file", str(key_file)) == (
        0, "s3cret-from-file")


def test_the_key_comes_from_the_environment(monkeypatch, llama_dir) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert _serve_key(monkeypatch, llama_dir) == (0, "from-env")
    assert _serve_key(monkeypatch, llama_dir, "--api-key", "flag") == (0, "flag")
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert _serve_key(monkeypatch, llama_dir) == (0, None)


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_a_missing_or_empty_key_file_is_refused(monkeypatch, llama_dir, tmp_path: Path,
                                                capsys, content: str | None) -> None:
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    status, key = _serve_key(monkeypatch, llama_dir, "--api-key-file", str(key_file))
    assert (status, key) == (2, "<not started>")
    assert "--api-key-file" in capsys.readouterr().err


def test_flag_and_file_together_are_refused(monkeypatch, llama_dir, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("k")
    status, _ = _serve_key(monkeypatch, llama_dir, "--api-key", "a",
                           "--api-key-file", str(tmp_path / "key"))
    assert status == 2


def test_the_flag_help_warns_about_cmdline() -> None:
    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command")
    serve_help = add_serve_parser(sub).format_help()
    assert "/proc/PID/cmdline" in serve_help and "PAGEDSERVE_API_KEY" in serve_help


def test_allow_special_tokens_in_content_reaches_the_server(monkeypatch, llama_dir) -> None:
    status, seen = _serve(monkeypatch, llama_dir)
    assert status == 0 and seen["kw"]["allow_special_tokens_in_content"] is False
    _, seen = _serve(monkeypatch, llama_dir, "--allow-special-tokens-in-content")
    assert seen["kw"]["allow_special_tokens_in_content"] is True
