"""Where one Muon optimizer step spends its time, phase by phase, next to AdamW's step.

The optimizer marks its phases as ``titan_muon/<phase>`` ranges for torch.profiler (the
same names appear in torchtitan's profiler traces). This script trains torchtitan's llama3
under FSDP2 on W gloo ranks with Muon and, in the same processes on the same batches, AdamW
with torch's default (for-loop) kernel and with the fused one; it times every step without
the profiler, then profiles Muon's step alone and sums each phase per step:

    python scripts/profile_step.py                     # debug model, 2 k tokens per step
    python scripts/profile_step.py --accum 8           # 16 k tokens per step

"beyond NS" is the unprofiled Muon step minus its Newton-Schulz time, on the rank whose NS
took longest, against each AdamW's whole step (the quantity bench_training.py reports). The
phase times are measured under the profiler, which adds about a microsecond per aten call.
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
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optimizer import ROOT, cpu_name, run_on_ranks, write_section  # noqa: E402
from bench_training import FLAVORS, MALLOC_SETTINGS, beyond_ns, build, optimizer_for, use_malloc  # noqa: E402

PHASES = (
    "reserve", "check_gradients", "pack", "wait", "assemble", "owner_momentum", "newton_schulz",
    "disassemble", "unpack", "commit_round", "stage_commit", "agree_on_success", "commit", "adamw",
)  # fmt: skip
COLLECTIVE_LAUNCHES = ("c10d::alltoall_base_",)  # the all-reduces run inside two of the phases
BASELINES = ("adamw", "adamw-fused")  # torch's default AdamW kernel (for-loop), and torchtitan's default


def _rank_main(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    vocab = FLAVORS[args.flavor]["vocab_size"]
    runs = {}
    for mode in (*BASELINES, args.mode):
        model = build(args.flavor, mesh, args.seq)
        runs[mode] = (model, optimizer_for(mode, model, "auto"))
    timings = {mode: [] for mode in runs}  # per step, as bench_training.py records them
    phases = []
    for step in range(args.warmup + args.steps):
        for mode, (model, opt) in runs.items():
            for profiled in (False,) if mode in BASELINES else (False, True):
                gen = torch.Generator().manual_seed(step * world + rank)
                for _ in range(args.accum):
                    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
                    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                    (loss / args.accum).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                dist.barrier()
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        opt.step()
                    if step >= args.warmup:
                        phases.append(_phase_ms(prof))
                else:
                    started = time.perf_counter()
                    opt.step()
                    if step >= args.warmup:
                        ns = 0.0 if mode in BASELINES else opt.last_step_metrics["muon/ns_time_ms"] / 1e3
                        timings[mode].append(dict(opt=time.perf_counter() - started, ns=ns))
                opt.zero_grad()
    return dict(runs={mode: dict(timings=t) for mode, t in timings.items()}, phases=phases)


def _phase_ms(prof) -> dict[str, float]:
    """Milliseconds per titan_muon phase, per collective launch and for the whole step."""
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.removeprefix("titan_muon/")
        if name in PHASES or event.key in COLLECTIVE_LAUNCHES or event.key.startswith("Optimizer.step#"):
            key = "step" if event.key.startswith("Optimizer.step#") else name
            totals[key] = totals.get(key, 0.0) + event.cpu_time_total / 1e3
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", choices=tuple(FLAVORS), default="debug")
    parser.add_argument("--mode", default="muon", choices=("muon", "muon+overlap"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--malloc", choices=tuple(MALLOC_SETTINGS), default="retain", help="as in bench_training.py")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    use_malloc(args.malloc)

    ranks = run_on_ranks(_rank_main, args.world, args)
    median = statistics.median
    runs = [r["runs"] for r in ranks]
    adamw, fused, step = (
        median(max(r[mode]["timings"][i]["opt"] for r in runs) for i in range(args.steps)) for mode in (*BASELINES, args.mode)
    )
    beyond = beyond_ns(runs, args.mode, args.steps)

    rows = [*PHASES, *COLLECTIVE_LAUNCHES]
    header = "| phase (ms per step, under the profiler) | " + " | ".join(f"rank {r}" for r in range(args.world)) + " |"
    lines = [header, "|---|" + "---|" * args.world]
    for name in [*rows, "other (Python between phases)", "step"]:
        cells = []
        for r in ranks:
            if name.startswith("other"):
                values = [p.get("step", 0.0) - sum(p.get(k, 0.0) for k in rows) for p in r["phases"]]
            else:
                values = [p.get(name, 0.0) for p in r["phases"]]
            cells.append(f"{median(values):.1f}")
        if any(c != "0.0" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

    cpu = cpu_name()
    tokens = args.world * args.batch * args.seq * args.accum
    command = "python scripts/profile_step.py " + " ".join(sys.argv[1:])
    section = f"## Step breakdown, {args.flavor}, {args.mode}, {tokens} tokens per step (scripts/profile_step.py)"
    report = "\n".join([
        section,
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, W={args.world}, {args.threads} thread(s) per rank, "
        f"malloc {args.malloc}; median of {args.steps} steps after {args.warmup} warm-up; {time.strftime('%Y-%m-%d')}.",
        "",
        f"Unprofiled, same run: Muon step {1e3 * step:.1f} ms, of which beyond NS {1e3 * beyond:.1f} ms; "
        f"AdamW step {1e3 * adamw:.1f} ms (for-loop), {1e3 * fused:.1f} ms (fused); "
        f"**beyond NS / AdamW = {beyond / adamw:.2f}× (for-loop), {beyond / fused:.2f}× (fused)** (goal ≤ 1.2×).",
        "",
        *lines,
        "",
        "`wait`: waiting for an all-to-all (transfer, or the other rank still computing); "
        "`c10d::*`: launching collectives (gloo copies the send buffer); `check_gradients` and "
        "`agree_on_success` include their all-reduce and the step's two host reads.",
        "",
    ])  # fmt: skip
    print(report)
    if not args.no_write:
        write_section(ROOT / "docs" / "performance.md", section, report)


if __name__ == "__main__":
    main()
