#!/usr/bin/env bash
# GPU checks for one CUDA GPU, in priority order under one deadline (default 470 s, so that the
# whole check fits an 8-minute slot with the installs; GPU_CHECK_SECONDS changes it). Each step
# has its own time box; a step cut short keeps the rows it printed (every script prints as it
# measures), and the steps after the deadline are listed as skipped.
#   1. scripts/ns_accuracy.py --full-size --time: fp16 Gram NS (what ns_dtype "auto" runs on CUDA
#      for rectangular matrices) against standard bf16 NS at Llama-3 8B and DeepSeek-V3 shapes:
#      time per matrix first, then distance to the float64 polar factor and rounding error;
#   2. tests/test_cuda.py and tests/test_clip_device.py: the step over a one-rank NCCL group on
#      real GPU tensors (host syncs counted on the device), MuonClip's recording on CUDA;
#   3. scripts/bench_gpu.py: the step's element-wise passes eager against compiled, fp16 Gram
#      against bf16 standard NS, the atomic against the streaming commit, against AdamW's default
#      and fused steps: time, NS time, "beyond NS" over fused AdamW, peak memory each step adds;
#      then scripts/measure_compiled_call.py: the host time of one compiled pass against one eager
#      op (the replay's compiled_call_s and launch_s, scale_replay/replay.py);
#   4. torchtitan's llama3 debug model (train_configs/llama3_gqa_*.toml, 300 steps, one GPU):
#      Muon with the CUDA defaults (standard bf16 NS: the debug model's matrices are below the
#      2048-row side where "auto" picks Gram on GPUs), Muon with fp16 Gram NS forced, AdamW: final
#      loss, mean loss over the last 50 steps, tokens/s, the loss difference between the two NS;
#   5. scripts/measure_qk_clip_recording.py --long: MuonClip's max-logit recording against SDPA at
#      sequence length 8192 (Llama-3 8B and DeepSeek-V3 layers), and FlexAttention's max scores;
#   6. float8 training (torchao's tensorwise recipe, compiled) with Muon on the debug model;
#   7. scripts/ns_gram_crossover.py: fp16 Gram against bf16 standard NS over 80 shapes and batch
#      sizes (what sets "auto" on GPUs), in what time is left.
# Installs: torchtitan 0.2.2 and what it needs from PyPI, or from wheels in .whl/ where the machine
# has no network (see docs/performance.md, "GPU"); the GPU's own torch is kept. titan_muon runs
# from this checkout (PYTHONPATH), so pip never replaces that torch.
# Writes at most 8 files to OUT_DIR: summary.md (each step's status and time, the key rows),
# device.txt, ns.md, tests.txt, bench.md, train.md, qk.md, crossover.md. Without a GPU it says so and
# exits 0.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default: gpu_check_out/
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU found (torch.cuda.is_available() is False); nothing was checked."
    exit 0
fi
out=$(mkdir -p "${1:-gpu_check_out}" && cd "${1:-gpu_check_out}" && pwd)
runs=$(mktemp -d /tmp/gpu_check_runs.XXXX)  # torchtitan dump folders (tensorboard), not kept
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-470}))
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.md"
echo "| step | status | seconds |" > "$summary"; echo "|---|---|---|" >> "$summary"

# run NAME BOX_SECONDS LOG CMD...: CMD under `timeout`, within both its box and the deadline.
run() {
    local name=$1 box=$2 log=$3; shift 3
    local left=$((deadline - SECONDS))
    if ((left < 15)); then echo "| $name | skipped (deadline) | 0 |" >> "$summary"; return; fi
    ((box > left)) && box=$left
    local started=$SECONDS status
    echo "### $name" >> "$log"
    timeout --kill-after 5 "$box" bash -c '"$@"' "$name" "$@" >> "$log" 2>&1; status=$?  # bash: CMD may be a function below
    case $status in 0) status=ok ;; 124 | 137) status="cut at ${box} s" ;; *) status="failed ($status)" ;; esac
    echo "| $name | $status | $((SECONDS - started)) |" >> "$summary"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; date -u; } > "$out/device.txt" 2>&1

install_torchtitan() {
    python -c "import torchtitan, torchao, datasets, tyro, torchdata" 2>/dev/null && return 0
    local site=/tmp/gpu_check_site
    if ls .whl/*.whl > /dev/null 2>&1; then
        python -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    else
        python -m pip install -q --no-deps --target "$site" torchtitan==0.2.2 torchao==0.18.0 datasets tyro torchdata \
            docstring-parser typeguard tomli dill multiprocess
    fi
}
export -f install_torchtitan
run "install torchtitan 0.2.2" 90 "$out/device.txt" install_torchtitan
export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
python -c "import torchtitan, torchao; print('torchtitan', torchtitan.__version__ if hasattr(torchtitan, '__version__') else '0.2.2', 'torchao', torchao.__version__)" >> "$out/device.txt" 2>&1

run "1. NS: fp16 Gram vs bf16 standard" 110 "$out/ns.md" \
    python scripts/ns_accuracy.py --device cuda --full-size --time --methods polar_express,keller
run "2. CUDA tests" 70 "$out/tests.txt" \
    python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_clip_device.py
run "3. step: fused vs eager, peak memory" 120 "$out/bench.md" python scripts/bench_gpu.py
run "3b. host time of a compiled pass" 40 "$out/bench.md" python scripts/measure_compiled_call.py --device cuda

train() {  # train NAME STEPS CONFIG [overrides...]
    local name=$1 steps=$2 config=$3; shift 3
    torchrun --standalone --nproc-per-node 1 -m titan_muon.torchtitan.train --job.config_file "$config" \
        --training.steps "$steps" --metrics.log_freq 5 --job.dump_folder "$runs/$name" "$@"
}
export -f train; export runs
run "4a. debug model: Muon (CUDA defaults)" 75 "$out/train.md" train muon_auto 300 train_configs/llama3_gqa_muon.toml
run "4b. debug model: Muon, fp16 Gram NS forced" 75 "$out/train.md" train muon_fp16_gram 300 train_configs/llama3_gqa_muon.toml \
    --optimizer.ns_algorithm gram
run "4c. debug model: AdamW" 60 "$out/train.md" train adamw 300 train_configs/llama3_gqa_adamw.toml

for shape in llama3_8b deepseek_v3; do
    run "5. MuonClip recording, $shape" 25 "$out/qk.md" python scripts/measure_qk_clip_recording.py --long --device cuda --shape "$shape"
    run "5. MuonClip recording, $shape, flex" 25 "$out/qk.md" python scripts/measure_qk_clip_recording.py --long --device cuda --shape "$shape" --flex
done
run "6. float8 training with Muon (compiled)" 90 "$out/train.md" train muon_float8 50 train_configs/llama3_gqa_muon.toml \
    --model.converters quantize.linear.float8 --compile.enable
run "7. NS crossover: fp16 Gram vs bf16 standard" 120 "$out/crossover.md" \
    python scripts/ns_gram_crossover.py --device cuda --batches 8,1 --seconds 100

python - "$runs" >> "$summary" 2>&1 <<'PY'
import os, sys
from titan_muon.torchtitan.harness import read_losses, read_scalars
runs = sys.argv[1]
print("\n| debug model run | final loss | mean loss, last 50 steps | median tokens/s | median optimizer step ms | median NS ms | mean abs. loss difference to muon_auto, same steps |\n|---|---|---|---|---|---|---|")
reference = {}
median = lambda values: sorted(values)[len(values) // 2] if values else float("nan")
for name in ("muon_auto", "muon_fp16_gram", "adamw", "muon_float8"):
    if not os.path.isdir(f"{runs}/{name}"):
        continue
    losses = read_losses(f"{runs}/{name}")
    if not losses:
        continue
    scalar = lambda tag: median(list(read_scalars(f"{runs}/{name}", tag).values()))
    last = max(losses)
    tail = [v for k, v in losses.items() if k > last - 50]
    reference = reference or losses  # muon_auto's, when it ran
    shared = [k for k in losses if k in reference]
    difference = sum(abs(losses[k] - reference[k]) for k in shared) / len(shared)
    print(f"| {name} | {losses[last]:.4f} (step {last}) | {sum(tail) / len(tail):.4f} | {scalar('throughput(tps)'):,.0f} | "
          f"{scalar('optimizer/step_time_ms'):.1f} | {scalar('muon/ns_time_ms'):.1f} | {difference:.4f} over {len(shared)} steps |")
PY
echo; cat "$summary"
echo "(all files: $out)"
