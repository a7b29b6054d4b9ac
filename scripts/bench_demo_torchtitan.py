#!/usr/bin/env python
"""DeMo-Muon vs full-sync Muon vs AdamW as torchtitan runs, 2 replicas × 2 shards (the first benchmark).

    PYTHONPATH=. python scripts/bench_demo_torchtitan.py --steps 240

The quality benchmark of issue 27 (lr sweeps, seeds, 1,000 steps, R = 2 and 4) is
scripts/bench_demo.py; this script is the earlier, single-seed torchtitan-trainer version
(docs/demo.md, "The first benchmark (torchtitan, 240 steps)"), kept because it runs the shipped
configs through torchtitan's own trainer, HSDP and validator.

Three torchtitan runs on 4 CPU ranks (torchrun, gloo), HSDP-style layout
``data_parallel_replicate_degree 2 × data_parallel_shard_degree 2``, same seed, same batches
(the data loader sees 4 data-parallel ranks in every run), same lr schedule:

* ``demo``:  train_configs/llama3_gqa_muon.toml with ``--optimizer.demo`` and nothing else (the
  one switch: chunk 64, top-k 8, α 1, the shared momentum over the replicas' average with the
  config's momentum 0.95 and Nesterov; issue 27). FSDP2 on each replica's shard mesh; the
  replicas exchange DeMo payloads of the Muon matrices and all-reduce the AdamW tensors'
  gradients (embeddings, output head, norms).
* ``demo:β:k``: DeMo as published (before issue 27): no shared momentum, α 0.2, no Nesterov,
  β = momentum, top-k k (``demo:0.999:8`` was the ``demo`` run of the first benchmark).
* ``muon``:  the same config without demo: plain HSDP (momentum 0.95, Nesterov: the config's).
* ``adamw``: train_configs/llama3_gqa_adamw.toml, plain HSDP.

Held-out loss: torchtitan 0.2.2's ``[validation]`` on ``python_stdlib_validation`` (the 1 in 20
stdlib files never trained on), every ``--val-freq`` steps, ``--val-steps`` batches per rank.
torchtitan's validator keeps its data cursor between evaluations (each would see the next slice
of the held-out files); the worker here rewinds it before each one, so every evaluation of every
run scores the same held-out tokens.

Bytes across replicas per step, per rank (ring wire model, docs/demo.md "Bytes"):
* demo: ``demo/bytes_sent`` (all-gather of the payloads) + ``demo/adamw_bytes_sent`` (dense
  all-reduce of the AdamW gradients), as logged by every rank;
* full sync (muon and adamw): HSDP all-reduces every rank's fp32 gradient shard over the R
  replicas: 2(R − 1)/R · 4 · N / S bytes per rank (N parameters, S shards), checked against
  the demo run's ``demo/bytes_dense`` + ``demo/adamw_bytes_sent`` summed over its ranks.
Traffic inside a replica (FSDP2's reduce-scatter/all-gather, Muon's exchange) is the same
kind in every run and not counted.

Prints a markdown table and writes ``--png`` (held-out loss vs step, bytes per step). DeMo
variants ``demo:β:k`` (e.g. ``--runs demo:0.99:8``) run into folders of their own; list them
with the three runs and ``--analyse-only`` to put them in the same table and figure.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKER_ENV = "TITAN_MUON_BENCH_DEMO_WORKER"
REPLICAS, SHARDS = 2, 2
CONFIGS = {
    "demo": "train_configs/llama3_gqa_muon.toml",
    "muon": "train_configs/llama3_gqa_muon.toml",
    "adamw": "train_configs/llama3_gqa_adamw.toml",
}
LABELS = {"muon": "Muon, full sync", "adamw": "AdamW, full sync"}
COLORS = {"demo": "tab:green", "muon": "tab:orange", "adamw": "tab:blue"}
VARIANT_COLORS = ["tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]
DEFAULT_TOPK = 8


def demo_settings(name: str, args) -> tuple[float, int]:
    """(β, top-k) of a published-DeMo variant ``demo:β:k``."""
    _, beta, topk = name.split(":")
    return float(beta), int(topk)


def demo_overrides(name: str, args) -> list[str]:
    """``demo``: the one switch (everything else the shipped config's and DeMo's defaults);
    ``demo:β:k``: DeMo as published, every setting explicit."""
    if name == "demo":
        return ["--optimizer.demo"]
    beta, topk = demo_settings(name, args)
    return ["--optimizer.demo", "--optimizer.no-demo_shared_momentum", "--optimizer.demo_alpha", "0.2",
            "--optimizer.no-nesterov", "--optimizer.momentum", str(beta), "--optimizer.demo_topk", str(topk)]  # fmt: skip


def folder(name: str, args) -> Path:
    if name.startswith("demo:"):
        beta, topk = demo_settings(name, args)
        return Path(args.out_dir) / f"demo_b{beta:g}_k{topk}"
    return Path(args.out_dir) / name


def label(name: str, args) -> str:
    if name == "demo":
        return f"DeMo-Muon (one switch: α 1, shared Nesterov momentum 0.95, k {DEFAULT_TOPK})"
    if name.startswith("demo"):
        beta, topk = demo_settings(name, args)
        return f"DeMo-Muon as published (α 0.2, β {beta:g}, k {topk})"
    return LABELS[name]


def worker() -> None:
    """One rank under torchrun: titan_muon.train, with a validator that rewinds its data."""
    from torchtitan.components import validate

    original = validate.Validator.validate

    def validate_same_tokens(self, model_parts, step):
        loader = self.validation_dataloader
        if loader.num_workers != 0:
            raise RuntimeError("rewinding the validation data needs validation.dataloader.num_workers = 0")
        loader.dataset._sample_idx, loader.dataset._token_buffer = 0, []
        return original(self, model_parts, step)

    validate.Validator.validate = validate_same_tokens

    from torchtitan.train import main

    from titan_muon.torchtitan import cpu
    from titan_muon.train import Trainer

    if cpu.should_use_cpu():
        cpu.use_cpu_device()
    main(Trainer)


def read_all_ranks(dump: Path) -> dict[int, dict[str, dict[int, float]]]:
    """``{rank: {tag: {step: value}}}`` from TensorBoard files written with save_for_all_ranks."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ranks: dict[int, dict[str, dict[int, float]]] = {}
    for run_dir in sorted(glob.glob(str(dump / "tb" / "*" / "rank_*"))):
        rank = int(run_dir.rsplit("rank_", 1)[1])
        events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        events.Reload()
        tags = ranks.setdefault(rank, {})
        for tag in events.Tags()["scalars"]:
            tags.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return ranks


def train(name: str, args) -> dict:
    from titan_muon.torchtitan.harness import finish, log_tail, start, torchrun_command

    dump = folder(name, args)
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    overrides = [
        "--job.dump_folder", str(dump), "--training.steps", str(args.steps), "--metrics.log_freq", "1",
        "--metrics.save_for_all_ranks", "--metrics.disable_color_printing",
        "--parallelism.data_parallel_replicate_degree", str(REPLICAS),
        "--parallelism.data_parallel_shard_degree", str(SHARDS),
        "--validation.enable", "--validation.dataset", "python_stdlib_validation",
        "--validation.freq", str(args.val_freq), "--validation.steps", str(args.val_steps),
        "--validation.local_batch_size", "4", "--validation.seq_len", "256",
    ]  # fmt: skip
    if name.startswith("demo"):
        overrides += demo_overrides(name, args)
    config = CONFIGS["muon" if name.startswith("demo") else name]
    command = torchrun_command(config, overrides, nproc=REPLICAS * SHARDS, entry=(str(Path(__file__).resolve()),))
    env = {WORKER_ENV: "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    result = finish(start(command, env=env), args.timeout)
    seconds = time.time() - started
    (dump / "rank0.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{log_tail(result)}")
    params = re.search(r"size: ([\d,]+) total parameters", result.stdout + result.stderr)
    summary = {"seconds": seconds, "params": int(params.group(1).replace(",", "")), "command": command}
    (dump / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{name}: {args.steps} steps in {seconds:.0f} s", flush=True)
    return summary


def full_sync_bytes_per_rank(params: int) -> float:
    """HSDP: each rank all-reduces its fp32 gradient shard (N/S elements) over R replicas."""
    return 2 * (REPLICAS - 1) / REPLICAS * 4 * params / SHARDS


def analyse(name: str, args) -> dict:
    dump = folder(name, args)
    summary = json.loads((dump / "summary.json").read_text())
    ranks = read_all_ranks(dump)
    if sorted(ranks) != list(range(REPLICAS * SHARDS)):
        raise RuntimeError(f"{dump}: TensorBoard files of ranks {sorted(ranks)}")
    tags = ranks[0]
    train_loss = tags["loss_metrics/global_avg_loss"]
    held_out = tags["validation_metrics/loss"]
    step_times = [tags["time_metrics/end_to_end(s)"][s] for s in sorted(tags["time_metrics/end_to_end(s)"])[1:]]
    steps = sorted(train_loss)
    out = {
        "train": train_loss,
        "held_out": held_out,
        "final_train": statistics.mean(train_loss[s] for s in steps[-args.window :]),
        "final_held_out": held_out[max(held_out)],
        "held_out_step": max(held_out),
        "step_s": statistics.median(step_times),
        "seconds": summary["seconds"],
        "params": summary["params"],
        "full_sync_bytes": full_sync_bytes_per_rank(summary["params"]),
    }
    if name.startswith("demo"):

        def per_rank(tag: str) -> list[float]:
            values = [ranks[r][tag] for r in sorted(ranks)]
            if any(len(set(v.values())) != 1 for v in values):
                raise RuntimeError(f"{tag} changes between steps")  # shapes fix the payloads
            return [next(iter(v.values())) for v in values]

        muon, adamw, dense = (
            per_rank("demo/bytes_sent"),
            per_rank("demo/adamw_bytes_sent"),
            per_rank("demo/bytes_dense"),
        )
        out.update(
            muon_bytes=statistics.mean(muon),
            adamw_bytes=statistics.mean(adamw),
            bytes=statistics.mean(m + a for m, a in zip(muon, adamw)),
            rank_bytes=[m + a for m, a in zip(muon, adamw)],
            dense_check=statistics.mean(d + a for d, a in zip(dense, adamw)),
            muon_dense=statistics.mean(dense),
        )
    else:
        out["bytes"] = out["full_sync_bytes"]
    return out


def styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """(color, line style) per run: the three runs solid, DeMo variants dashed."""
    variants = iter(VARIANT_COLORS)
    return {n: (COLORS[n], "-") if n in COLORS else (next(variants), "--") for n in names}


def plot(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = styles(list(results))
    figure, (loss_axes, bytes_axes) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.5, 1]})
    for name, result in results.items():
        steps = sorted(result["held_out"])
        color, line = style[name]
        loss_axes.plot(
            steps, [result["held_out"][s] for s in steps], line, marker="o", markersize=3, color=color,
            label=label(name, args),
        )  # fmt: skip
    tokens = args.val_steps * 4 * 256 * REPLICAS * SHARDS
    loss_axes.set(xlabel="step", ylabel="held-out loss", title=f"Held-out loss ({tokens:,} held-out tokens)")
    low = min(min(r["held_out"].values()) for r in results.values())
    high = max(r["held_out"][s] for r in results.values() for s in r["held_out"] if s >= args.val_freq)
    loss_axes.set_ylim(low - 0.1, high + 0.1)  # from the first evaluation after step 1
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(fontsize=8)

    full = max(r["full_sync_bytes"] for r in results.values())
    for i, (name, result) in enumerate(results.items()):
        color = style[name][0]
        if name.startswith("demo"):
            first = i == next(j for j, n in enumerate(results) if n.startswith("demo"))
            adamw, muon = result["adamw_bytes"] / 1e6, result["muon_bytes"] / 1e6
            bytes_axes.bar(i, adamw, color="tab:gray", label="AdamW tensors, dense all-reduce" if first else None)
            bytes_axes.bar(i, muon, bottom=adamw, color=color, label="Muon matrices, DeMo payloads" if first else None)
        else:
            bytes_axes.bar(i, result["bytes"] / 1e6, color=color)
        text = f"{result['bytes'] / 1e6:.2f} MB"
        if result["bytes"] < full:
            text += f"\n{full / result['bytes']:.1f}× less"
        bytes_axes.text(i, result["bytes"] / 1e6, text, ha="center", va="bottom", fontsize=8)
    ticks = [label(n, args).replace(" (", "\n").replace(", ", "\n").rstrip(")") for n in results]
    bytes_axes.set_xticks(range(len(results)), ticks, fontsize=7)
    bytes_axes.set(
        ylabel="MB sent across replicas per step and rank",
        title=f"Traffic between {REPLICAS} replicas (× {SHARDS} shards)",
    )
    bytes_axes.set_ylim(0, max(r["bytes"] for r in results.values()) / 1e6 * 1.25)
    bytes_axes.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    png = REPO / args.png
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    print(f"wrote {png}")


def table(results: dict, args) -> str:
    full = max(r["full_sync_bytes"] for r in results.values())
    last_eval = max(r["held_out_step"] for r in results.values())
    rows = [
        f"| run | train loss, mean of last {args.window} steps | held-out loss, step {last_eval} "
        "| bytes across replicas per step and rank | vs full sync | wall time per step (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = "1×" if r["bytes"] == full else f"{full / r['bytes']:.1f}× fewer"
        ratio = ratio if r["bytes"] <= full else f"{r['bytes'] / full:.2f}× more"
        losses = f"{r['final_train']:.4f} | {r['final_held_out']:.4f}"
        rows.append(f"| {label(name, args)} | {losses} | {r['bytes']:,.0f} | {ratio} | {r['step_s']:.2f} s |")
    lines = ["\n".join(rows)]
    if "demo" in results:
        d = results["demo"]
        by_rank = ", ".join(f"{b:,.0f}" for b in d["rank_bytes"])
        lines.append(
            f"DeMo bytes per rank: Muon-matrix payloads {d['muon_bytes']:,.0f} (dense all-reduce of the same "
            f"matrices {d['muon_dense']:,.0f}: {d['muon_dense'] / d['muon_bytes']:.0f}× fewer) + AdamW tensors "
            f"{d['adamw_bytes']:,.0f}; by rank {by_rank}. Full sync: 2(R−1)/R·4·N/S with N = {d['params']:,} "
            f"parameters = {d['full_sync_bytes']:,.0f}; the demo run's logged dense equivalent "
            f"(bytes_dense + adamw_bytes_sent, mean over ranks) = {d['dense_check']:,.0f}."
        )
    lines.append("Whole runs: " + ", ".join(f"{label(n, args)} {r['seconds']:.0f} s" for n, r in results.items()) + ".")
    return "\n\n".join(lines)


def main() -> None:
    if os.environ.get(WORKER_ENV) == "1":
        return worker()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--val-freq", type=int, default=20, help="held-out loss every this many steps (and at step 1)")
    parser.add_argument("--val-steps", type=int, default=8, help="held-out batches (4 × 256 tokens) per rank")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final train loss")
    parser.add_argument(
        "--runs",
        default="demo,muon,adamw",
        help="demo, muon, adamw, or a DeMo variant demo:β:k (e.g. demo:0.99:8), comma-separated",
    )
    parser.add_argument("--out-dir", default=str(REPO / "outputs" / "bench_demo_torchtitan"))
    parser.add_argument("--png", default="docs/demo_quality_torchtitan240.png")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    parser.add_argument("--analyse-only", action="store_true", help="reuse the runs under --out-dir")
    args = parser.parse_args()
    if importlib.util.find_spec("matplotlib") is None:  # fail before the minutes of training
        sys.exit("bench_demo.py draws its figure with matplotlib: pip install matplotlib (the [plots] extra)")

    names = args.runs.split(",")
    if not args.analyse_only:
        for name in names:
            train(name, args)
    results = {name: analyse(name, args) for name in names}
    plot(results, args)
    print(f"Command: python scripts/bench_demo_torchtitan.py {' '.join(sys.argv[1:])}".strip())
    print()
    print(table(results, args))


if __name__ == "__main__":
    main()
