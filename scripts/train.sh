#!/usr/bin/env bash
# Train the Llama 3 GQA debug model with Muon on 2 CPU ranks (or 2 GPUs if present):
# a few hundred steps on the offline Python-stdlib corpus, console log + TensorBoard.
#
#   scripts/train.sh                                  # 300 steps, about 6 minutes on 2 cores
#   scripts/train.sh --training.steps 50              # any torchtitan / titan_muon override
#   CONFIG=train_configs/mla_muon.toml scripts/train.sh
#   NPROC=4 scripts/train.sh
#
# Multi-node: run the same command on every node with
#   torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB ...
# (see docs/torchtitan.md). Automatic restarts: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 3 ...
# (see docs/reliability.md).
set -euo pipefail

cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-train_configs/llama3_gqa_muon.toml}
NPROC=${NPROC:-2}
DUMP=${DUMP:-./outputs/$(basename "$CONFIG" .toml)}
# A fresh rendezvous store per restart: torch 2.13's shared one breaks torchrun --max-restarts
# (docs/reliability.md); rank 0 then hosts the store, as torch 2.4 did.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

torchrun --standalone --nproc-per-node "$NPROC" --local-ranks-filter 0 \
    -m titan_muon.torchtitan.train --job.config_file "$CONFIG" --job.dump_folder "$DUMP" "$@"

echo
echo "Logs: TensorBoard event files under $DUMP/tb/ (one folder per run start)."
echo "Open them with:  tensorboard --logdir $DUMP/tb   (then browse http://localhost:6006)"
