"""Wait until a Ray cluster has the nodes (and GPUs) a pagedserve engine will ask for.

    python deploy/scripts/wait_for_nodes.py --nodes 3 --gpus 16 --timeout 900

Exits 0 once at least ``--nodes`` nodes are alive and, with ``--gpus``, the cluster's GPU total
reaches that number; exits 1 on timeout. A head that is still starting counts as waiting. Run
it on a cluster node: it attaches with ``address="auto"`` unless ``--address`` or
``RAY_ADDRESS`` says otherwise. Run it before ``pagedserve generate/serve --address auto``: an
engine started on a half-joined cluster waits for its placement group and fails after its
placement timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _snapshot(ray) -> tuple[int, float]:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(float(n.get("Resources", {}).get("GPU", 0.0)) for n in alive)
    return len(alive), gpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, required=True, help="alive nodes to wait for")
    parser.add_argument("--gpus", type=float, default=0, help="cluster GPU total to wait for")
    parser.add_argument("--timeout", type=float, default=600, help="seconds (default 600)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    args = parser.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    while True:  # the head may still be starting (a script run right after `ray start`)
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except ConnectionError as exc:
            if time.monotonic() > deadline:
                print(f"cannot reach the Ray cluster at {args.address!r}: {exc}", file=sys.stderr)
                return 1
            time.sleep(2.0)
    try:
        last = None
        while True:
            nodes, gpus = _snapshot(ray)
            if (nodes, gpus) != last:
                print(f"{nodes}/{args.nodes} nodes alive, {gpus:g}/{args.gpus:g} GPUs", flush=True)
                last = (nodes, gpus)
            if nodes >= args.nodes and gpus >= args.gpus:
                return 0
            if time.monotonic() > deadline:
                print(f"timed out after {args.timeout:g}s; `ray status` shows what joined",
                      file=sys.stderr)
                return 1
            time.sleep(2.0)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
