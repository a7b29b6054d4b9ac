"""Host time of one call to the step's compiled element-wise pass, next to one eager op.

The step trace (scale_replay/step_trace.py) records each compiled call and its kernels; the replay
(scale_replay/replay.py) charges the host ``compiled_call_s`` for launching it, where an eager op costs
``launch_s``. A torch.compile'd function does more on the host than an eager op: dynamo's guards,
AOTAutograd's runtime wrapper, inductor's wrapper, then the kernel launch. This measures it
through the entry point the step uses (``Elementwise``, which takes lists of blocks), for one block
and for ``COMPILED_LIST`` blocks in one call, on blocks small enough that the kernels themselves
are negligible:

* *hot*: call after call, the host's caches holding the wrappers' code and data;
* *after a sweep* (CPU only): each call after streaming 32 MiB through the caches, as a CPU step
  does between its passes (its passes are the sweep). A GPU step's host does not touch the data,
  so there the hot figure is the one that applies.

On CUDA nothing synchronizes inside the timed loop (the host time of the calls, as a step sees
it); the GPU work of a 4 K-element block is a few microseconds.

    python scripts/measure_compiled_call.py [--device cuda] [--calls 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_optimizer import cpu_name  # noqa: E402

from titan_muon.algorithm.update import COMPILED_LIST, Elementwise  # noqa: E402

BLOCK = 4096  # elements: a kernel of a few microseconds on any device
SWEEP_BYTES = 32 << 20


def per_call_us(fn, calls: int, device: torch.device, between=None) -> float:
    """Median host microseconds of fn() over `calls` calls (between() untimed before each)."""
    times = []
    for _ in range(calls):
        if between is not None:
            between()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU benchmarks' ranks use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    momenta, outs = torch.zeros(COMPILED_LIST, BLOCK, device=device).unbind(), torch.empty(COMPILED_LIST, BLOCK, device=device).unbind()
    grads = torch.randn(COMPILED_LIST, BLOCK, device=device).unbind()
    momentum, out, grad = momenta[0], outs[0], grads[0]
    compiled, eager = Elementwise(compiled=True, device_type=device.type), Elementwise(compiled=False)
    rows = {
        "eager op (momentum.lerp_)": lambda: momentum.lerp_(grad, 0.05),
        "eager pass (two ops)": lambda: eager.momenta_and_nesterov_inputs_([momentum], [out], [grad], 0.95, True),
        "compiled pass, one block (one kernel)": lambda: compiled.momenta_and_nesterov_inputs_([momentum], [out], [grad], 0.95, True),
        f"compiled pass, {COMPILED_LIST} blocks in one call": lambda: compiled.momenta_and_nesterov_inputs_(
            list(momenta), list(outs), list(grads), 0.95, True),
    }
    for fn in rows.values():  # compiles, and warms every path
        for _ in range(3):
            fn()
    source, sink = torch.randn(SWEEP_BYTES // 4), torch.empty(SWEEP_BYTES // 4)
    sweep = None if device.type == "cuda" else (lambda: sink.copy_(source))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"{name}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {time.strftime('%Y-%m-%d')}; "
          f"block of {BLOCK} fp32 elements, median of {args.calls} calls\n")  # fmt: skip
    print("| call | host µs, hot | host µs, after a sweep |\n|---|---|---|")
    for label, fn in rows.items():
        hot = per_call_us(fn, args.calls, device)
        cold = f"{per_call_us(fn, args.calls, device, sweep):.1f}" if sweep is not None else "n/a (GPU host)"
        print(f"| {label} | {hot:.1f} | {cold} |")


if __name__ == "__main__":
    main()
