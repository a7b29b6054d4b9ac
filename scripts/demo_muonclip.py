"""MuonClip demonstration: max attention logits with and without QK-clip, same run otherwise.

Trains the llama3 GQA debug model with Muon at a high learning rate twice on 2 ranks:
first recording max logits without clipping (qk_clip on with an unreachable tau, so the
recorder runs but never clips), then with tau set to a fraction of that run's peak. Writes
docs/muonclip_demo.png (max logit per step, both runs) and prints a markdown table.

    python scripts/demo_muonclip.py                  # 80 steps, lr 0.06, tau = 50 % of the unclipped peak
    python scripts/demo_muonclip.py --tau 5 --steps 150
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plotting import pyplot, require_matplotlib  # noqa: E402

from titan_muon.torchtitan.harness import read_losses, read_scalars, run_training  # noqa: E402

CONFIG = "train_configs/llama3_gqa_muon.toml"


def train(name: str, tau: float, args) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    dump = REPO / "outputs" / "demo_muonclip" / name
    shutil.rmtree(dump, ignore_errors=True)
    run_training(
        CONFIG,
        [
            "--job.dump_folder", str(dump), "--training.steps", str(args.steps), "--metrics.log_freq", "1",
            "--optimizer.lr", str(args.lr), "--optimizer.qk_clip_tau", str(tau), "--lr_scheduler.warmup_steps", "5",
            "--training.seq_len", str(args.seq_len),
        ],  # fmt: skip
        timeout=args.timeout,
    )
    return (
        read_scalars(str(dump), "qk_clip/max_logit"),
        read_scalars(str(dump), "qk_clip/heads_clipped"),
        read_losses(str(dump)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=0.06, help="Muon lr, high on purpose so logits grow")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tau", type=float, default=None, help="default: 50 %% of the unclipped run's peak")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    require_matplotlib("scripts/demo_muonclip.py")  # before the training, not after

    free, _, free_loss = train("unclipped", 1e30, args)
    tau = args.tau if args.tau is not None else 0.5 * max(free.values())
    capped, clipped_heads, capped_loss = train("clipped", tau, args)

    plt = pyplot("scripts/demo_muonclip.py")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(free), [free[s] for s in sorted(free)], label="Muon, no clipping")
    ax.plot(sorted(capped), [capped[s] for s in sorted(capped)], label=f"MuonClip, tau = {tau:.2f}")
    ax.axhline(tau, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("max pre-softmax logit (all layers, heads)")
    ax.set_title(f"llama3 GQA debug model, 2 CPU ranks, Muon lr {args.lr}")
    ax.legend()
    fig.tight_layout()
    out = REPO / "docs" / "muonclip_demo.png"
    fig.savefig(out, dpi=120)

    last = max(capped)
    print(f"Command: python scripts/demo_muonclip.py {' '.join(sys.argv[1:])}".strip())
    print()
    print("| run | peak max logit | max logit at last step | heads clipped (sum over steps) | final loss |")
    print("|---|---|---|---|---|")
    print(f"| no clipping | {max(free.values()):.2f} | {free[max(free)]:.2f} | 0 | {free_loss[max(free_loss)]:.3f} |")
    print(f"| MuonClip, tau {tau:.2f} | {max(capped.values()):.2f} | {capped[last]:.2f} | "
          f"{sum(clipped_heads.values()):.0f} | {capped_loss[max(capped_loss)]:.3f} |")  # fmt: skip
    print(f"\nPlot: {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
