"""One bad request costs nobody else anything (issue 27): hypothesis bodies from
``benchmarks/scripts/fuzz_server.py`` (every numeric field at and past its bounds, huge ints, NaN,
lone surrogates, bytes that are not UTF-8, control-token text, odd roles, unknown fields) go to
a live server. No answer is a 5xx, the engine never restarts, /health answers throughout, and
afterwards nothing runs and no KV block is held. The seed is fixed: the same bodies each run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from helpers.live_server import live_server

from pagedserve.serving.openai.limits import ServerLimits
from pagedserve.serving.openai.server import build_app

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "fuzz_server.py"
EXAMPLES = 40
# The script holds /health to 100 ms with the server in a process of its own. Here the server,
# the engine, hypothesis and the prober share one process (and the suite's other worker the
# cores): the bound only catches a stall, such as a request blocking the event loop.
HEALTH_BOUND_MS = 2000.0


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_server", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzzed_requests_cost_nobody_anything(llama_dir, srv) -> None:
    fuzz_server = _script()
    client = srv.start_client(llama_dir, max_model_len=fuzz_server.MAX_MODEL_LEN)
    try:
        engine = client.engine
        restarts, failures = engine.num_restarts, engine.restarts.recent_failures
        limits = ServerLimits()
        with live_server(build_app(client, limits=limits), limits) as url:
            report = fuzz_server.fuzz(url, examples=EXAMPLES, seed=0, probe_process=False)
        report["restarts"] = engine.num_restarts - restarts
        print({k: report[k] for k in ("outcomes", "per_shape", "health", "fuzz_s")})
        assert report["examples"] == EXAMPLES
        assert report["server_errors"] == 0, report["bad"]
        assert report["restarts"] == 0 and engine.restarts.recent_failures == failures
        assert not report["health"]["failures"], report["health"]
        assert report["health"]["max_ms"] < HEALTH_BOUND_MS, report["health"]
        assert report["running"] == 0 and report["blocks_used"] == 0, report
        # Both kinds of answer are exercised: bodies the server serves, and refusals.
        assert report["outcomes"].get("200", 0) >= EXAMPLES // 5
        assert report["outcomes"].get("400", 0) >= EXAMPLES // 5
        assert fuzz_server.passed(report, HEALTH_BOUND_MS)
    finally:
        client.shutdown()
