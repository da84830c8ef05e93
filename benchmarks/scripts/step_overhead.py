"""Per-step control overhead: one round trip controller -> every rank -> controller for a
256-request decode step, over our ZeroMQ step channel and over one Ray actor call per rank.

Both paths run side by side on the same local Ray instance and the same N worker actors, which
decode the step and (on the output rank) return a 256-token ``ModelRunnerOutput``; there is no
model compute, so the times are the control plane alone.

  zmq  ``StepChannel.broadcast`` + ``recv_reply``; each actor runs ``StepReceiver`` in one
       long-running remote method (its busy loop, as the engine's workers do).
  ray  ``ray.get([w.execute.remote(step) for w in workers])``, passing the dataclass.

The two alternate in rounds so that drift on a busy machine hits both alike.

    python benchmarks/scripts/step_overhead.py                  # 2 ranks
    python benchmarks/scripts/step_overhead.py --ranks 4
    python benchmarks/scripts/step_overhead.py --num-reqs 1       # the transport floor
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import time

import ray

from pagedserve.cluster.wire import StepChannel
from pagedserve.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    decode,
    encode,
)

NUM_REQS = 256
BLOCK_SIZE = 16


def decode_step(step_id: int, num_reqs: int = NUM_REQS) -> SchedulerOutput:
    """What the scheduler sends for a steady decode step: every request running, one new token
    each, and a new block for the requests whose last block just filled (about 1 in 16)."""
    ids = [f"cmpl-{i:04d}" for i in range(num_reqs)]
    lens = [200 + (i * 37) % 700 + step_id for i in range(num_reqs)]
    return SchedulerOutput(
        step_id=step_id,
        cached_reqs=CachedRequestData(
            req_ids=ids,
            new_token_ids=[[(step_id * 131 + i * 7) % 32000] for i in range(num_reqs)],
            new_block_ids=[
                [[5000 + step_id * 8 + i % 8]] if n % BLOCK_SIZE == 0 else None
                for i, n in enumerate(lens)
            ],
            num_computed_tokens=lens,
        ),
        num_scheduled_tokens={r: 1 for r in ids},
        total_num_scheduled_tokens=num_reqs,
    )


def output_for(step: SchedulerOutput) -> ModelRunnerOutput:
    ids = step.cached_reqs.req_ids
    tokens = [[(step.step_id * 17 + i) % 32000] for i in range(len(ids))]
    return ModelRunnerOutput(step.step_id, list(ids), tokens)


@ray.remote(num_cpus=0)
class BenchRank:
    """A worker actor that does everything a rank does per step except the forward pass."""

    def __init__(self, rank: int, output_rank: int) -> None:
        self.rank = rank
        self.is_output_rank = rank == output_rank

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        return output_for(step) if self.is_output_rank else None

    def serve(self, endpoints: tuple[str, str]) -> int:
        """The rank's receive loop over the step channel, until the controller says stop."""
        from pagedserve.workers.wire import ChannelStopped, StepReceiver, StepReceiveTimeout

        served = 0
        node = ray.get_runtime_context().get_node_id()
        with StepReceiver(endpoints, self.rank, self.is_output_rank, node=node) as rx:
            while True:
                try:
                    step = rx.recv(timeout_s=30.0)
                except StepReceiveTimeout:
                    continue  # idle between rounds; the controller's stop ends the loop
                except ChannelStopped:
                    return served
                try:
                    if self.is_output_rank:
                        rx.reply(output_for(step))
                except Exception as exc:
                    rx.reply_error(exc)
                    raise
                served += 1


def run_zmq(workers: list, host: str, steps: list[SchedulerOutput], warmup: int) -> list[int]:
    chan = StepChannel(len(workers), host=host, output_rank=0)
    try:
        loops = [w.serve.remote(chan.endpoints) for w in workers]
        deadline = time.monotonic() + 60
        while not chan.ready:
            # Short handshake slices, so that a rank whose loop died is reported at once.
            done, _ = ray.wait(loops, timeout=0)
            if done:
                ray.get(done)
                raise RuntimeError("a rank's receive loop ended before the handshake")
            try:
                chan.wait_ready(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        times: list[int] = []
        for i, step in enumerate(steps):
            t0 = time.perf_counter_ns()
            chan.broadcast(step)
            out = chan.recv_reply(timeout_s=10.0)
            t1 = time.perf_counter_ns()
            assert out.step_id == step.step_id and len(out.sampled_token_ids) == len(
                step.cached_reqs.req_ids
            )
            if i >= warmup:
                times.append(t1 - t0)
        if missing := chan.stop_workers(timeout_s=10.0):
            raise RuntimeError(f"ranks {missing} did not leave their receive loop")
        served = ray.get(loops, timeout=30)
        assert all(n == len(steps) for n in served), served
        return times
    finally:
        chan.close()


def run_ray(workers: list, steps: list[SchedulerOutput], warmup: int) -> list[int]:
    times: list[int] = []
    for i, step in enumerate(steps):
        t0 = time.perf_counter_ns()
        outs = ray.get([w.execute.remote(step) for w in workers], timeout=10.0)
        t1 = time.perf_counter_ns()
        out = outs[0]
        assert out.step_id == step.step_id
        assert len(out.sampled_token_ids) == len(step.cached_reqs.req_ids)
        if i >= warmup:
            times.append(t1 - t0)
    return times


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summarize(ns: list[int]) -> dict[str, float]:
    us = [t / 1000 for t in ns]
    return {
        "median": statistics.median(us),
        "p90": percentile(us, 0.90),
        "p99": percentile(us, 0.99),
        "mean": statistics.fmean(us),
    }


def codec_cost(step: SchedulerOutput, reps: int = 300) -> tuple[float, float]:
    """Median encode and decode time of one step in this process, in µs."""
    frame = encode(step)
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        encode(step)
        t1 = time.perf_counter_ns()
        decode(frame)
        t2 = time.perf_counter_ns()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(enc) / 1000, statistics.median(dec) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="worker actors (default 2)")
    ap.add_argument("--steps", type=int, default=250, help="measured steps per round and path")
    ap.add_argument("--rounds", type=int, default=4, help="alternating zmq/ray rounds")
    ap.add_argument("--warmup", type=int, default=50, help="unmeasured steps per round")
    ap.add_argument(
        "--num-reqs", type=int, default=NUM_REQS, help="running requests per step (default 256)"
    )
    ap.add_argument("--host", default=None, help="address to bind (default: Ray's node IP)")
    args = ap.parse_args()
    n = args.num_reqs

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        host = args.host or ray.util.get_node_ip_address()
        workers = [BenchRank.remote(r, 0) for r in range(args.ranks)]
        ray.get([w.node_id.remote() for w in workers], timeout=120)

        per_round = args.warmup + args.steps
        zmq_ns: list[int] = []
        ray_ns: list[int] = []
        for r in range(args.rounds):
            base = r * per_round * 2
            zmq_ns += run_zmq(
                workers, host, [decode_step(base + k, n) for k in range(per_round)], args.warmup
            )
            base += per_round
            ray_ns += run_ray(
                workers, [decode_step(base + k, n) for k in range(per_round)], args.warmup
            )
    finally:
        ray.shutdown()

    sample = decode_step(1000, n)
    enc_us, dec_us = codec_cost(sample)
    z, y = summarize(zmq_ns), summarize(ray_ns)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, Ray {ray.__version__}, local Ray instance; "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"step: {n} running requests x 1 token; msgpack frame {len(encode(sample))} B "
        f"(pickle {len(pickle.dumps(sample))} B); output frame "
        f"{len(encode(output_for(sample)))} B"
    )
    print(f"codec in one process: encode {enc_us:.0f} µs, decode {dec_us:.0f} µs per step")
    print(
        f"ranks={args.ranks}, {args.rounds} rounds x {args.steps} measured steps per path "
        f"(+{args.warmup} warm-up each)\n"
    )
    print("| path | median µs | p90 µs | p99 µs | mean µs |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("ZeroMQ step channel", z), ("Ray call per rank", y)):
        print(f"| {name} | {s['median']:.0f} | {s['p90']:.0f} | {s['p99']:.0f} | {s['mean']:.0f} |")
    print(
        f"\nRay / ZeroMQ: {y['median'] / z['median']:.1f}x at the median, "
        f"{y['p90'] / z['p90']:.1f}x at p90"
    )


if __name__ == "__main__":
    main()
