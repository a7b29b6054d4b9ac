"""Pipeline parallel x FSDP on 4 CPU ranks equals FSDP on 2 ranks, with and without overlap.

    python scripts/check_pipeline_fsdp.py [--steps 4] [--flavor tiny_gqa]

Too slow for CI on 2 cores (four torchrun launches, two of them with 4 ranks), so run by
hand. From one seed checkpoint (1 rank) it trains train_configs/llama3_gqa_muon.toml
(MuonClip off) as
  * fsdp:          2 ranks, FSDP 2 (the reference: the same 2-way data split);
  * pp_fsdp:       4 ranks, PP 2 x FSDP 2 (each stage's Muon exchanges over its 2 FSDP ranks);
  * pp_fsdp_overlap: the same with --optimizer.overlap (gradients sent during backward).
It prints, per run and step, the loss and grad norm, their largest relative difference from
the reference, and the Muon traffic (bytes sent in the step, rounds sent during backward),
then exits 1 if a difference exceeds --rel (the bound of tests/test_pipeline_parallel.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_muon.torchtitan.harness import read_scalars, run_training  # noqa: E402

CONFIG = "train_configs/llama3_gqa_muon.toml"
PP = ["--parallelism.pipeline_parallel_degree", "2"]
RUNS = {"fsdp": (2, []), "pp_fsdp": (4, PP), "pp_fsdp_overlap": (4, [*PP, "--optimizer.overlap"])}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "muon/bytes_sent", "muon/rounds_sent_in_backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--flavor", default="tiny_gqa")
    parser.add_argument("--rel", type=float, default=1e-5)
    parser.add_argument("--folder", default=str(REPO / "outputs" / "check_pipeline_fsdp"))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)

    def overrides(dump: str, *extra: str) -> list[str]:
        return [
            "--model.flavor", args.flavor, "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.steps", str(args.steps), "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--model.hf_assets_path", str(folder / "tokenizer"),
            "--job.dump_folder", str(folder / dump), "--optimizer.no-qk_clip", *extra,
        ]  # fmt: skip

    create_seed = overrides("seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    run_training(CONFIG, create_seed, nproc=1, timeout=args.timeout)
    seed_path = str(folder / "seed" / "checkpoint" / "step-0")
    seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed_path, "--checkpoint.load_only"]
    scalars, seconds = {}, {}
    for name, (nproc, extra) in RUNS.items():
        start = time.perf_counter()
        run_training(CONFIG, overrides(name, *seed, *extra), nproc=nproc, timeout=args.timeout)
        seconds[name] = time.perf_counter() - start
        scalars[name] = {tag: read_scalars(str(folder / name), tag) for tag in TAGS}

    print(f"Command: python scripts/check_pipeline_fsdp.py {' '.join(sys.argv[1:])}".strip())
    print()
    print("| run | ranks | step | loss | grad norm | Muon bytes sent | rounds sent in backward |")
    print("|---|---|---|---|---|---|---|")
    for name, (nproc, _) in RUNS.items():
        values = scalars[name]
        for step in sorted(values[TAGS[0]]):
            row = [values[tag].get(step, 0.0) for tag in TAGS]
            print(f"| {name} | {nproc} | {step} | {row[0]:.7f} | {row[1]:.7f} | {row[2]:.0f} | {row[3]:.0f} |")
    print()
    worst = 0.0
    reference = scalars["fsdp"]
    for name in list(RUNS)[1:]:
        for tag in TAGS[:2]:
            diffs = [abs(v / reference[tag][s] - 1) for s, v in scalars[name][tag].items()]
            worst = max(worst, *diffs)
            print(f"{name} vs fsdp, {tag}: largest relative difference {max(diffs):.2e}")
    print("wall seconds: " + ", ".join(f"{name} {s:.0f}" for name, s in seconds.items()))
    sys.exit(0 if worst <= args.rel else 1)


if __name__ == "__main__":
    main()
