"""The scale replay: the real ``Muon.step()`` of every rank traced on ``meta`` tensors over a fake
process group (step_trace.py, meta_device.py), and the trace replayed with CUDA + NCCL semantics
(replay.py) for the model presets (model_presets.py) at any world size (simulate.py); the plan's
traffic per rank (traffic.py). A tool beside the package: titan_muon never imports it. The
commands are scripts/simulate_scale.py, scripts/measure_traffic.py, scripts/calibrate_replay.py."""
