"""A real uvicorn server for an app, configured as ``serve`` configures it (the header read
timeout included), on a free port of 127.0.0.1 in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def live_server(app: Any, limits: Any, *, sndbuf: int | None = None) -> Iterator[str]:
    """Serve ``app`` under ``limits``; yield its base URL. ``sndbuf``: the send buffer of every
    accepted connection (Linux copies it from the listening socket), so that a client that
    stops reading blocks the server's writes after kilobytes, not megabytes."""
    import uvicorn

    from pagedserve.serving.openai.http_server import uvicorn_config

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="critical", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
