"""One model at one W, flat and hierarchical exchange, traced and replayed (scale_replay/step_trace.py,
scale_replay/replay.py) on H100 nodes of 8: the replayed step time of each, for docs/exchange.md.

    python scripts/compare_hierarchical.py --model "Llama-3 8B" --world 128 --workers 2

Every rank's real ``Muon.step()`` is traced on meta with what CUDA gets by default (bf16 wire and
Newton–Schulz), once with ``hierarchical_exchange=False`` and once with ``True`` (``ranks_per_node``
= the hardware's GPUs per node), and the traces are replayed with per-rank streams, the relay of a
hierarchical exchange on a stream of its own.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import platform
import sys
import time


import torch._dynamo  # noqa: E402, F401 - imported once here, not by every forked worker's first DTensor
from scale_replay.replay import replay
from scale_replay.simulate import CUDA_DEFAULTS, H100, adamw_params, models
from scale_replay.step_trace import Collective, trace_rank


def _trace(job):
    rank, world, model_name, hierarchical = job
    model = models()[model_name]
    return trace_rank(rank, world, list(model.params), adamw_params(model), **CUDA_DEFAULTS,
                      hierarchical_exchange=hierarchical, ranks_per_node=H100.gpus_per_node)  # fmt: skip


def run(model: str, world: int, hierarchical: bool, workers: int) -> dict:
    jobs = [(rank, world, model, hierarchical) for rank in range(world)]
    start = time.perf_counter()
    if workers <= 1:
        traces = [_trace(job) for job in jobs]
    else:
        with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=1) as pool:
            traces = pool.map(_trace, jobs, chunksize=1)
    traced_s = time.perf_counter() - start
    results = replay(traces, H100)
    peers = max(
        len({p for t in [trace] for e in t.events if isinstance(e, Collective) and e.kind == "all_to_all"
             for p, out, into in zip(e.comm[0], e.sent, e.received) if p != trace.rank and (out or into)})
        for trace in traces
    )  # fmt: skip
    return {
        "step_ms": 1e3 * max(r.finish_s for r in results.values()),
        "bound_ms": 1e3 * max(r.bound_s for r in results.values()),
        "ns_ms": 1e3 * max(r.newton_schulz_s for r in results.values()),
        "wire_ms": 1e3 * max(r.wire_s for r in results.values()),
        "gb_sent": max(r.bytes_sent for r in results.values()) / 1e9,
        "peers": peers,
        "rounds": traces[0].metrics.get("muon/rounds", 0.0),
        "traced_s": traced_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3 8B", choices=sorted(models()))
    parser.add_argument("--world", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.model}, W = {args.world}, {H100.gpus_per_node} H100 per node; traced on {platform.processor() or platform.machine()}, "
          f"{datetime.date.today()}")  # fmt: skip
    print("| exchange | replayed step (ms) | bound (ms) | NS, busiest rank (ms) | wire, busiest rank (ms) | GB sent, busiest rank | "
          "peers per rank | rounds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for hierarchical in (False, True):
        row = run(args.model, args.world, hierarchical, args.workers)
        name = "hierarchical" if hierarchical else "flat"
        print(f"| {name} | {row['step_ms']:.2f} | {row['bound_ms']:.2f} | {row['ns_ms']:.2f} | {row['wire_ms']:.2f} | "
              f"{row['gb_sent']:.3f} | {row['peers']} | {row['rounds']:.0f} |", flush=True)  # fmt: skip
        print(f"  ({name}: traced in {row['traced_s']:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
