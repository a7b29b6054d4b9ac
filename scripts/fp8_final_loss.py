"""Final loss with fp32 vs fp8 (and bf16) Muon momentum on the default data, same seed and batches.

    python scripts/fp8_final_loss.py --steps 150

Trains train_configs/llama3_gqa_muon.toml on 2 ranks once per momentum dtype and prints the
mean loss over the last --window steps and its difference from fp32 (goal: fp8 within 0.5 %).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_muon.torchtitan.harness import read_losses, run_training  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--dtypes", default="fp32,fp8,bf16")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()

    means = {}
    for dtype in args.dtypes.split(","):
        dump = REPO / "outputs" / "fp8_final_loss" / dtype
        shutil.rmtree(dump, ignore_errors=True)
        run_training(
            "train_configs/llama3_gqa_muon.toml",
            ["--job.dump_folder", str(dump), "--training.steps", str(args.steps), "--metrics.log_freq", "1",
             "--optimizer.momentum_dtype", dtype],  # fmt: skip
            timeout=args.timeout,
        )
        losses = read_losses(str(dump))
        means[dtype] = statistics.mean(losses[s] for s in sorted(losses)[-args.window :])

    print(f"Command: python scripts/fp8_final_loss.py {' '.join(sys.argv[1:])}".strip())
    print()
    print(f"| momentum | mean loss, last {args.window} of {args.steps} steps | vs fp32 |")
    print("|---|---|---|")
    for dtype, mean in means.items():
        print(f"| {dtype} | {mean:.4f} | {100 * (mean / means['fp32'] - 1):+.2f} % |")


if __name__ == "__main__":
    main()
