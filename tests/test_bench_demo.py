"""Smoke test of scripts/bench_demo.py (the DeMo quality benchmark): the whole pipeline, tiny.

A 3-step benchmark of a 2-layer dim-64 model on the byte-level stdlib corpus: full-sync Muon (one
process) and DeMo-Muon on 2 gloo replica processes, one lr, one seed; then the summary JSON,
the table and the figure. Also that full sync as one process on the whole batch equals 2
data-parallel processes (the shortcut the benchmark takes for its full-sync arms).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_demo.py"
TINY = ["--model", "tiny", "--tokenizer", "bytes", "--steps", "3", "--val-every", "2", "--val-tokens", "1024", "--test-tokens", "2048"]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path / "out")], env=env, check=False,
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the figure needs matplotlib")
def test_bench_demo_smoke(tmp_path):
    json_path, png = tmp_path / "q.json", tmp_path / "q.png"
    result = run(["--arms", "muon,demo", "--replicas", "2", "--lr-mults", "1", "--seeds", "1", "--poll", "0.2",
                  "--json", str(json_path), "--png", str(png), *TINY], tmp_path)  # fmt: skip
    summary = json.loads(json_path.read_text())
    assert png.stat().st_size > 0
    muon, demo = summary["arms"]["muon_R1"], summary["arms"]["demo_R2"]
    params = summary["meta"]["params"]
    assert muon["bytes"] == {"2": 8.0 * params}  # full sync: 8(R − 1)N over all replicas
    assert 0 < demo["bytes"]["2"] < muon["bytes"]["2"] and demo["bytes_ratio"] > 1
    assert demo["bytes_muon"] * 100 < demo["bytes_dense_muon"]  # the Muon matrices' payloads are small
    for entry in (muon, demo):
        assert 4 < entry["test_mean"] < 7 and set(entry["curve"]) == {"0", "2", "3"}
    assert "| DeMo-DCT" in result.stdout and "parity" in result.stdout


def test_full_sync_one_process_equals_data_parallel(tmp_path):
    losses = {}
    for processes in (1, 2):
        out = tmp_path / f"muon{processes}.json"
        run(["run", "--arm", "muon", "--sync-processes", str(processes), "--out", str(out), *TINY], tmp_path)
        losses[processes] = json.loads(out.read_text())
    one, two = losses[1], losses[2]
    assert two["processes"] == 2
    assert one["train_loss"] == pytest.approx(two["train_loss"], rel=1e-5)
    assert one["test"] == pytest.approx(two["test"], rel=1e-5)
