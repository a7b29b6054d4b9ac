"""What Muon's step costs beyond Newton–Schulz, next to fused AdamW's whole step (issue 25's CPU criteria).

torchtitan's llama3 (~100M by default) under FSDP2 on W gloo ranks, gradients set directly (no
forward or backward: this measures the optimizer alone). In the same processes, step after step
in turn on the same gradients:

* fused AdamW (torch's ``fused=True``, torchtitan's default), the yardstick;
* Muon at its defaults, each step twice: with its phases timed by the host clock
  (``titan_muon.timing.PhaseClock``), and under torch.profiler. "Around NS" is the step minus
  its ``newton_schulz`` phase and its waits for the other ranks (NS imbalance, transfers): the
  ``wait`` phases of the exchange and ``agree_on_success``, the final all-reduce, where a rank
  whose NS ended first waits for the others; on the rank where what remains is longest. Under
  the profiler it includes the profiler's own cost per operation. Adding the NS phase's own
  operations other than its matrix products (normalization, the mirrored half of each
  symmetric product, casts) gives "beyond the NS products";
* the same with ``measure_update_rms = False``: a step whose metrics are not logged (the
  torchtitan adapter measures ``muon/update_rms`` in logged steps only; with torchtitan's
  default log_freq of 10 that is nine steps in ten);
* with ``--compiled``, both again with ``compile_elementwise=True``: the element-wise passes as
  torch.compile'd kernels, as on CUDA (on CPU the default runs them eagerly);
* Muon with ``ns_steps`` = 1 and 6: the step with zero NS iterations extrapolated from the two
  (t(0) = t(1) − (t(6) − t(1)) / 5), the measure issue 25 was filed with. Gram NS's first Gram
  product and its final application to the matrix do not grow with ns_steps, so they land in
  it: it counts matrix products as well as element-wise work.

Each rank's step time is the slowest rank's (the others wait for it in the all-to-all). Every
figure is run once per glibc malloc setting (``--mallocs retain,default``: ranks told to keep
freed memory, as a caching allocator does, and glibc's defaults, what a CPU user gets).

    python scripts/bench_beyond_ns.py                 # ~100M, W = 2, both malloc settings
    python scripts/bench_beyond_ns.py --flavor debug  # quick look

Writes a section of docs/performance.md unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optimizer import ROOT, cpu_name, run_on_ranks, write_section  # noqa: E402
from bench_training import FLAVORS, MALLOC_SETTINGS, build, use_malloc  # noqa: E402
from profile_step import COLLECTIVE_LAUNCHES, PHASES, _phase_ms  # noqa: E402

from titan_muon import Muon, build_param_groups  # noqa: E402
from titan_muon.timing import PhaseClock  # noqa: E402

# NS itself, and waiting for the other ranks' NS: in the exchange (`wait`), and in the final
# agreement's all-reduce, where a rank whose NS ended first waits for the others (the
# all-reduce's own work, 0.6–0.8 ms per step on the ~100M model, is counted as waiting too)
NS_PHASES = ("newton_schulz", "wait", "agree_on_success")
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")
EXTRAPOLATED_FROM = (1, 6)  # ns_steps of the two runs whose difference is five NS iterations


def _gradients(model, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=gen) * 1e-3
        grads.append(DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()))
    return grads


def _ns_operations_ms(prof) -> float:
    """Milliseconds of the operations run directly inside the newton_schulz phase other than its
    matrix products (their own children included)."""
    total = 0.0
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and parent.name == "titan_muon/newton_schulz" and event.name not in GEMMS:
            total += event.cpu_time_total / 1e3
    return total


# (label, compile_elementwise, measure_update_rms): the Muon steps profiled and timed
VARIANTS = (("logged", False, True), ("not logged", False, False), ("compiled, logged", True, True), ("compiled, not logged", True, False))


def _rank_main(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    variants = [v for v in VARIANTS if args.compiled or not v[1]]
    names = ["adamw-fused", "muon", *(["muon compiled"] if args.compiled else []), *(f"muon ns_steps={k}" for k in EXTRAPOLATED_FROM)]
    runs = {}
    for name in names:
        model = build(args.flavor, mesh, 16)
        if name == "adamw-fused":
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        else:
            ns_steps = int(name.rsplit("=", 1)[1]) if "=" in name else 5
            opt = Muon(build_param_groups(model), lr=3e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_steps=ns_steps,
                       compile_elementwise=name == "muon compiled")  # fmt: skip
        runs[name] = (model, opt)
    # per run or variant: (step, NS_PHASES) seconds of each timed step; per variant: profiled phases
    times = {name: [] for name in [*runs, *(label for label, *_ in variants)]}
    phases = {label: [] for label, *_ in variants}
    for step in range(args.warmup + args.steps):
        for name, (model, opt) in runs.items():
            if name in ("muon", "muon compiled"):  # each of its variants timed, then profiled
                steps = [(v, profiled) for v in variants if v[1] == (name == "muon compiled") for profiled in (False, True)]
            else:
                steps = [(None, False)]
            for variant, profiled in steps:
                for p, g in zip(model.parameters(), _gradients(model, step * world + rank)):
                    p.grad = g
                if variant is not None:
                    opt.measure_update_rms = variant[2]
                dist.barrier()
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        opt.step()
                    if step >= args.warmup:
                        phases[variant[0]].append(_phase_ms(prof) | {"ns_operations": _ns_operations_ms(prof)})
                else:
                    with PhaseClock() as clock:
                        started = time.perf_counter()
                        opt.step()
                        elapsed = time.perf_counter() - started
                    if step >= args.warmup:
                        times[name if variant is None else variant[0]].append((elapsed, sum(clock.ms[k] for k in NS_PHASES) / 1e3))
                opt.zero_grad()
    return dict(times=times, phases=phases)


def _slowest(ranks, name: str, i: int) -> float:
    return max(r["times"][name][i][0] for r in ranks)


def _around_by_host_clock(ranks, name: str, i: int) -> float:
    """Step i's time outside its NS_PHASES (host-timed, PhaseClock) on the rank where that is longest."""
    return max(step - ns_and_waits for step, ns_and_waits in (r["times"][name][i] for r in ranks))


def summarize(ranks, steps: int) -> dict:
    """fused AdamW's step, the extrapolation to zero NS iterations, and per Muon variant its step,
    around NS (host clock and profiled) and beyond the NS products, in seconds."""
    median = statistics.median
    a, b = EXTRAPOLATED_FROM
    fused = median(_slowest(ranks, "adamw-fused", i) for i in range(steps))
    at_a = median(_slowest(ranks, f"muon ns_steps={a}", i) for i in range(steps))
    at_b = median(_slowest(ranks, f"muon ns_steps={b}", i) for i in range(steps))
    summary = dict(fused=fused, no_iterations=at_a - a * (at_b - at_a) / (b - a), variants={})
    for label, phases in ranks[0]["phases"].items():
        if not phases:
            continue
        around = [median(p["step"] - sum(p.get(k, 0.0) for k in NS_PHASES) for p in r["phases"][label]) for r in ranks]
        inside = [median(p["ns_operations"] for p in r["phases"][label]) for r in ranks]
        slowest = max(range(len(ranks)), key=lambda r: around[r] + inside[r])
        summary["variants"][label] = dict(
            step=median(_slowest(ranks, label, i) for i in range(steps)),
            around_host_clock=median(_around_by_host_clock(ranks, label, i) for i in range(steps)),
            around=around[slowest] / 1e3,
            beyond_products=(around[slowest] + inside[slowest]) / 1e3,
        )
    return summary


def phase_table(ranks, name: str) -> list[str]:
    rows = [*PHASES, *COLLECTIVE_LAUNCHES]
    lines = ["| phase (ms per step, under the profiler) | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " |",
             "|---|" + "---|" * len(ranks)]  # fmt: skip
    for row in [*rows, "ns_operations", "other (Python between phases)", "step"]:
        cells = []
        for r in ranks:
            if row.startswith("other"):
                values = [p.get("step", 0.0) - sum(p.get(k, 0.0) for k in rows) for p in r["phases"][name]]
            else:
                values = [p.get(row, 0.0) for p in r["phases"][name]]
            cells.append(f"{statistics.median(values):.1f}")
        if any(c != "0.0" for c in cells):
            label = "(of newton_schulz: its operations other than matrix products)" if row == "ns_operations" else row
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", choices=tuple(FLAVORS), default="100m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="also Muon with compile_elementwise=True")
    parser.add_argument("--mallocs", default="retain,default", help=f"comma-separated, of {tuple(MALLOC_SETTINGS)}")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    results = {}
    for malloc in args.mallocs.split(","):
        use_malloc(malloc)
        ranks = run_on_ranks(_rank_main, args.world, args)
        tables = {label: phase_table(ranks, label) for label, phases in ranks[0]["phases"].items() if phases}
        results[malloc] = (summarize(ranks, args.steps), tables)

    def ratio(seconds, s):
        return f"{1e3 * seconds:.1f} ({seconds / s['fused']:.2f}×)"

    lines = ["| malloc | fused AdamW step ms | Muon step | Muon step ms | around NS ms, host clock (× fused AdamW; goal ≤ 1.5×) | "
             "around NS, profiled | beyond the NS products, profiled (goal ≤ 3×) | beyond the NS iterations, extrapolated |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for malloc, (s, _) in results.items():
        for label, v in s["variants"].items():
            lines.append(f"| {malloc} | {1e3 * s['fused']:.1f} | {label} | {1e3 * v['step']:.1f} | {ratio(v['around_host_clock'], s)} | "
                         f"{ratio(v['around'], s)} | {ratio(v['beyond_products'], s)} | {ratio(s['no_iterations'], s)} |")  # fmt: skip
    cpu = cpu_name()
    command = "python scripts/bench_beyond_ns.py " + " ".join(sys.argv[1:])
    section = f"## Beyond Newton–Schulz, {args.flavor}, optimizer alone (scripts/bench_beyond_ns.py)"
    body = [
        section,
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, W={args.world}, {args.threads} thread(s) per rank; "
        f"median of {args.steps} steps after {args.warmup} warm-up, each the slowest rank's; {time.strftime('%Y-%m-%d')}.",
        "",
        *lines,
        "",
        "Muon steps: \"not logged\" with `measure_update_rms = False` (the commit's pass sums no squares; nine "
        "steps in ten at torchtitan's default log_freq), \"compiled\" with `compile_elementwise=True` (the passes as "
        "CUDA runs them by default). \"around NS\": the step minus its `newton_schulz`, `wait` and `agree_on_success` "
        "phases (the final all-reduce, where a rank whose NS ended first waits for the others), "
        "timed by the host clock (`titan_muon.timing.PhaseClock`) or under torch.profiler (whose cost per operation "
        "it then includes), on the rank where it is longest; \"beyond the NS products\": that plus the NS phase's operations other than matrix products "
        "(both on the rank where they are largest); \"beyond the NS iterations\": unprofiled steps at ns_steps = "
        f"{EXTRAPOLATED_FROM[0]} and {EXTRAPOLATED_FROM[1]} extrapolated "
        "to none (it includes Gram NS's first and last products, which do not grow with ns_steps).",
        "",
    ]
    for malloc, (_, tables) in results.items():
        for name, table in tables.items():
            body += [f"Phases, Muon {name}, malloc {malloc}:", "", *table, ""]
    report = "\n".join(body)
    print(report)
    if not args.no_write:
        write_section(ROOT / "docs" / "performance.md", section, report)


if __name__ == "__main__":
    main()
