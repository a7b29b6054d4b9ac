#!/usr/bin/env bash
# GPU checks, for a machine with a CUDA GPU (see docs/performance.md, "GPU"):
#   1. the CUDA tests (one-rank NCCL, host syncs counted on the real device) and the meta suite;
#   2. scripts/bench_gpu.py: bf16 Newton-Schulz against torch.mm; Muon's step with its element-wise
#      passes eager and compiled (compile_elementwise) against AdamW's default and fused steps: time,
#      NS time, "beyond NS" over fused AdamW's step, peak memory each step allocates;
#   3. scripts/measure_qk_clip_recording.py --long: MuonClip's max-logit recording against the
#      SDPA forward at sequence length 8192 (time, peak extra memory), Llama-3-8B and DeepSeek-V3
#      layers (docs/muonclip.md, "Memory and time at sequence length 8192"), and with --flex the
#      fused path: FlexAttention's kernel returning max scores, its cost and its agreement;
#   4. scripts/ns_accuracy.py --full-size --time: fp16 Gram NS (what ns_dtype/ns_algorithm "auto"
#      run on CUDA for rectangular matrices) against standard bf16 NS at Llama-3 8B (4096x14336,
#      4096x4096, 1024x4096) and DeepSeek-V3 (7168x2048) shapes: distance to the float64 polar
#      factor, largest singular value, time per matrix (docs/newton_schulz.md, "Half-precision
#      Gram NS"), and whether gram-newton-schulz's symmetric GEMM kernels were found;
#   5. a 1-GPU torchtitan llama3 debug run, Muon against AdamW (loss and step time).
# Without a GPU it says so and exits 0.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default: gpu_check_out/
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU found (torch.cuda.is_available() is False); nothing was checked."
    exit 0
fi
out=${1:-gpu_check_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"

python -m pytest -q tests/test_cuda.py tests/test_meta_device.py tests/test_clip_device.py 2>&1 | tee "$out/tests.txt"
python scripts/bench_gpu.py | tee "$out/bench.md"
for shape in llama3_8b deepseek_v3; do
    python scripts/measure_qk_clip_recording.py --long --device cuda --shape "$shape" | tee -a "$out/qk_clip_recording.md"
    python scripts/measure_qk_clip_recording.py --long --device cuda --shape "$shape" --flex | tee -a "$out/qk_clip_recording.md"
done
python scripts/ns_accuracy.py --device cuda --full-size --time --methods polar_express,keller | tee "$out/ns_fp16_gram.md"

for optimizer in muon adamw; do
    config=train_configs/llama3_gqa_${optimizer}.toml
    torchrun --standalone --nproc-per-node 1 -m titan_muon.torchtitan.train --job.config_file "$config" \
        --training.steps 100 --metrics.log_freq 10 --job.dump_folder "$out/$optimizer" 2>&1 | tee "$out/train_$optimizer.txt"
done
python - "$out" <<'PY'
import sys
from titan_muon.torchtitan.harness import read_losses, read_scalars
out = sys.argv[1]
for name in ("muon", "adamw"):
    losses = read_losses(f"{out}/{name}")
    tps = read_scalars(f"{out}/{name}", "tps")
    last = max(losses)
    print(f"{name}: loss at step {last} = {losses[last]:.4f}; median tokens/s = {sorted(tps.values())[len(tps) // 2] if tps else 'n/a'}")
PY
