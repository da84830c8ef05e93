"""``serve`` from the command line: argument parsing, and one real server process."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from pagedserve.serving.cli.serve import add_serve_parser, engine_options, run_serve

RUNNER = (
    "import argparse, sys\n"
    "from pagedserve.serving.cli.serve import add_serve_parser, run_serve\n"
    "p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='command')\n"
    "add_serve_parser(sub)\n"
    "sys.exit(run_serve(p.parse_args(sys.argv[1:])))\n"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser


def test_defaults_and_engine_options() -> None:
    args = _parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 8000, None, None)
    args = _parser().parse_args([
        "serve", "--model", "/m", "--port", "9", "--api-key", "k", "--block-size", "32",
        "--max-model-len", "100", "--max-num-seqs", "4", "--kv-cache-memory-bytes", "1000",
        "--no-prefix-caching", "--tp", "2", "--dcp", "2",
    ])
    opts = engine_options(args)
    assert opts["block_size"] == 32 and opts["max_model_len"] == 100
    assert opts["max_num_seqs"] == 4 and opts["kv_cache_memory_bytes"] == 1000
    assert opts["enable_prefix_caching"] is False
    assert opts["tensor_parallel_size"] == 2 and opts["decode_context_parallel_size"] == 2
    assert opts["data_parallel_size"] == 1 and opts["ray_address"] is None
    assert opts["kv_cache_dtype"] == "auto" and opts["calculate_kv_scales"] is False
    args = _parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales"])
    opts = engine_options(args)
    assert opts["kv_cache_dtype"] == "fp8_e4m3" and opts["calculate_kv_scales"] is True


def test_speculative_config_is_json_and_checked_by_name(capsys) -> None:
    args = _parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_options(args)["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--speculative-config", "ngram"])  # not JSON
    assert "not JSON" in capsys.readouterr().err
    args = _parser().parse_args(["serve", "--model", "/m", "--speculative-config",
                                 '{"method": "ngram", "lookahead": 3}'])
    assert run_serve(args) == 2
    assert "speculative_config.lookahead" in capsys.readouterr().err


def test_bad_engine_option_returns_2(capsys) -> None:
    args = _parser().parse_args(["serve", "--model", "/m", "--block-size", "3"])
    assert run_serve(args) == 2
    assert "block_size" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_process_answers_and_stops_on_sigint(llama_dir) -> None:
    port = _free_port()
    cmd = [
        sys.executable, "-c", RUNNER, "serve", "--model", str(llama_dir), "--port", str(port),
        "--api-key", "k", "--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 22),
        "--log-level", "warning", "--backend", "local",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "tiny-llama"
        assert models["data"][0]["max_model_len"] == 128
        out = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                         json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
