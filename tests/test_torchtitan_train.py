"""titan_muon.torchtitan.train under torchrun on CPU/gloo: tiny models, a few steps each.

Every launch goes through a subprocess with a timeout, so a hang fails the test. One
2-rank reference run (8 steps, checkpoint at step 4) is shared by most tests.
"""

import shutil
from pathlib import Path

import pytest
import torch
from distributed import one_sequence_corpus, tiny_run_flags, trainer_flags

from titan_muon.torchtitan.harness import (
    local_nodes_rendezvous,
    log_tail,
    read_checkpoint,
    read_losses,
    read_scalars,
    run_together,
    run_training,
    torchrun_command,
)  # fmt: skip

pytestmark = pytest.mark.timeout(1800)

MUON = "train_configs/llama3_gqa_muon.toml"
STEPS, RESUME_STEP = 8, 4
RUN_TIMEOUT = 600  # seconds; a run takes ~20 s on an idle 2-core machine, minutes on a busy one


def run_training_with_timeout(*args, **kwargs):
    return run_training(*args, timeout=RUN_TIMEOUT, **kwargs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchtitan")


def tiny(workdir: Path, dump: str, *extra: str) -> list[str]:
    return [*tiny_run_flags(workdir, dump, STEPS), *trainer_flags(), *extra]


CHECKPOINT_AT_RESUME_STEP = [
    "--checkpoint.enable", "--checkpoint.interval", str(RESUME_STEP), "--checkpoint.no-last-save-model-only",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """2 ranks, 8 steps of Muon on the stdlib corpus, checkpoints at steps 4 and 8."""
    run_training_with_timeout(MUON, tiny(workdir, "reference", *CHECKPOINT_AT_RESUME_STEP))
    return workdir / "reference"


def copy_checkpoint(reference: Path, workdir: Path, dump: str, step: int = RESUME_STEP) -> Path:
    target = workdir / dump / "checkpoint" / f"step-{step}"
    shutil.copytree(reference / "checkpoint" / f"step-{step}", target)
    return target


def test_muon_run_logs_loss_and_optimizer_metrics(reference):
    losses = read_losses(str(reference))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    for tag in ("grad_norm", "muon/update_rms", "muon/bytes_sent", "muon/step_time_ms", "optimizer/step_time_ms"):
        values = read_scalars(str(reference), tag)
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        assert all(value > 0 for value in values.values()), tag


def test_resume_continues_exactly_like_the_straight_run(reference, workdir):
    copy_checkpoint(reference, workdir, "resumed")
    run_training_with_timeout(MUON, tiny(workdir, "resumed", *CHECKPOINT_AT_RESUME_STEP))
    straight, resumed = read_losses(str(reference)), read_losses(str(workdir / "resumed"))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}  # bit for bit


@pytest.fixture(scope="module")
def one_sequence_reference(reference, workdir) -> tuple[Path, list[str]]:
    corpus = one_sequence_corpus(workdir, workdir / "tokenizer")
    data = ["--training.dataset", "text_files", "--training.dataset_path", str(corpus)]
    run_training_with_timeout(MUON, tiny(workdir, "one_sequence_2", *data, *CHECKPOINT_AT_RESUME_STEP))
    return workdir / "one_sequence_2", data


@pytest.mark.parametrize("nproc", [1, 4])
def test_reshard_from_2_ranks(one_sequence_reference, workdir, nproc):
    reference, data = one_sequence_reference
    dump = f"one_sequence_{nproc}"
    copy_checkpoint(reference, workdir, dump)
    overrides = tiny(workdir, dump, *data, "--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader")
    run_training_with_timeout(MUON, overrides, nproc=nproc)
    expected, resumed = read_losses(str(reference)), read_losses(str(workdir / dump))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    # Only the order of gradient sums differs (~1e-7 relative). AdamW may turn that into a
    # large change of an update only where v is near zero, i.e. where the gradient and hence
    # the loss's dependence on that weight are near zero: losses of ~8 agree to ~1e-6.
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-5), step


def test_truncated_checkpoint_fails_clearly(reference, workdir):
    target = copy_checkpoint(reference, workdir, "truncated")
    shard = target / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = run_training_with_timeout(MUON, tiny(workdir, "truncated", "--checkpoint.enable"), check=False)
    assert result.returncode != 0
    assert "__1_0.distcp is truncated" in log_tail(result, 20000)


def test_changed_muon_adamw_split_fails_clearly(reference, workdir):
    copy_checkpoint(reference, workdir, "moved")
    moved = ["--checkpoint.enable", "--optimizer.adamw_patterns", "layers.0.attention.*"]
    result = run_training_with_timeout(MUON, tiny(workdir, "moved", *moved), check=False)
    log = log_tail(result, 20000)
    assert result.returncode != 0
    assert "different optimizer setup" in log
    assert "layers.0.attention.wq.weight: checkpoint has ['momentum_buffer']" in log


def test_two_nodes_match_one_node(reference, workdir):
    """Two launches with --nnodes 2 and one rank each, rendezvous over c10d on 127.0.0.1."""
    command = torchrun_command(MUON, tiny(workdir, "two_nodes"), nproc=1, rdzv=local_nodes_rendezvous(2))
    # Bit for bit: the same ranks, layouts and thread counts (torchrun would set OMP_NUM_THREADS=1
    # only with several ranks per node; tests/conftest.py sets it for every launch), and a run is
    # deterministic (docs/reliability.md, "Portability").
    results = run_together(command, 2, timeout=RUN_TIMEOUT)
    assert [r.returncode for r in results] == [0, 0], "\n".join(log_tail(r, 4000) for r in results)
    assert read_losses(str(workdir / "two_nodes")) == read_losses(str(reference))


VALIDATION = [
    "--validation.enable", "--validation.dataset", "python_stdlib_validation", "--validation.freq", "3",
    "--validation.steps", "2", "--validation.seq_len", "64", "--validation.local_batch_size", "2",
]  # fmt: skip


@pytest.mark.parametrize(
    "config, flavor, extra",
    [
        ("train_configs/mla_muon.toml", "tiny_dense", []),  # torchtitan's deepseek_v3 has no validator
        ("train_configs/llama3_gqa_adamw.toml", "tiny_gqa", VALIDATION),
    ],
)
def test_other_configs_train(workdir, config, flavor, extra):
    dump = workdir / Path(config).stem
    run_training_with_timeout(config, tiny(workdir, dump.name, "--training.steps", "3", "--model.flavor", flavor, *extra))
    assert sorted(read_losses(str(dump))) == [1, 2, 3]
    if extra:
        assert sorted(read_scalars(str(dump), "validation_metrics/loss")) == [1, 3]  # step 1, then every 3
    muon_metrics = read_scalars(str(dump), "muon/rounds")
    if "adamw" in config:  # the baseline really runs torchtitan's AdamW: no Muon step was logged
        assert muon_metrics == {}
    else:  # mla_muon.toml: split, overlap, fp8 momentum and MuonClip are what it exists for
        assert all(v > 0 for v in read_scalars(str(dump), "muon/rounds_sent_in_backward").values())  # overlap
        per_element = read_scalars(str(dump), "muon/momentum_bytes_per_element")
        # fp8: one code byte per element plus one exponent byte per row and 256-column block, so
        # 1 + 1/cols for matrices narrower than 256 columns (this tiny model's are >= 32 wide);
        # bf16 would be 2 and fp32 4
        assert per_element and all(1.0 < v <= 1 + 1 / 32 for v in per_element.values()), per_element
        assert read_scalars(str(dump), "qk_clip/max_logit")  # MuonClip recorded the logits


def test_mla_with_split_overlap_and_fp8_resumes_exactly(workdir):
    """train_configs/mla_muon.toml turns on split, overlap, fp8 momentum and MuonClip (forced to clip here)."""
    config, steps = "train_configs/mla_muon.toml", ["--model.flavor", "tiny_dense", "--training.steps", "4", "--optimizer.qk_clip_tau", "0.05"]
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only"]
    run_training_with_timeout(config, tiny(workdir, "mla_straight", *steps, *checkpoint))
    straight = workdir / "mla_straight"
    target = workdir / "mla_resumed" / "checkpoint" / "step-2"
    shutil.copytree(straight / "checkpoint" / "step-2", target)
    run_training_with_timeout(config, tiny(workdir, "mla_resumed", *steps, *checkpoint))
    expected, resumed = read_losses(str(straight)), read_losses(str(workdir / "mla_resumed"))
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: expected[step] for step in resumed}
    assert any(v > 0 for v in read_scalars(str(straight), "muon/rounds_sent_in_backward").values())  # overlap ran
    assert any(v > 0 for v in read_scalars(str(straight), "qk_clip/heads_clipped").values())  # MuonClip clipped
    # Max logits start near 0.07 on this model; each clipped step brings them back to tau.
    assert any(v > 0.05 for v in read_scalars(str(straight), "qk_clip/max_logit").values())


def assert_same_checkpoint(path: Path, expected_path: Path) -> None:
    """Every entry of two DCP checkpoints (weights, optimizer state, schedulers, data position) equal, bit for bit."""
    got, expected = read_checkpoint(str(path)), read_checkpoint(str(expected_path))
    assert sorted(got) == sorted(expected)
    differ = [k for k, v in expected.items() if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]
    assert not differ, f"{path} differs from {expected_path} in {differ[:8]}"


def resume_from(straight: Path, workdir: Path, dump: str, step: int, overrides: list[str]) -> dict[int, float]:
    """Losses of a run resumed from ``straight``'s step-``step`` checkpoint (copied into a new dump folder)."""
    shutil.copytree(straight / "checkpoint" / f"step-{step}", workdir / dump / "checkpoint" / f"step-{step}")
    run_training_with_timeout(MUON, tiny(workdir, dump, *overrides))
    return read_losses(str(workdir / dump))


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_checkpoint_equals_the_synchronous_one_and_resumes_exactly(reference, workdir, mode):
    """[checkpoint] async_mode: torchtitan snapshots the state dict (our optimizer's state_dict()
    runs on the training thread, inside dcp.async_save) and writes it from a thread ("async") or a
    separate process while the next step's forward and backward run ("async_with_pinned_mem"; on
    the CPU without pinned memory, cpu.stage_checkpoints_without_accelerator). A write racing the
    next step would store some of step 5's values under step 4: the same run with synchronous
    saves (the shared reference) gives the expected files, entry by entry."""
    dump = f"async_{mode}"
    run_training_with_timeout(MUON, tiny(workdir, dump, *CHECKPOINT_AT_RESUME_STEP, "--checkpoint.async_mode", mode))
    assert read_losses(str(workdir / dump)) == read_losses(str(reference))  # saving changed nothing
    assert_same_checkpoint(workdir / dump / "checkpoint" / f"step-{RESUME_STEP}", reference / "checkpoint" / f"step-{RESUME_STEP}")
    resumed = resume_from(workdir / dump, workdir, f"{dump}_resumed", RESUME_STEP, ["--checkpoint.enable"])
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: read_losses(str(reference))[step] for step in resumed}  # bit for bit


ASYNC_EVERY_2 = [
    "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only",
]  # fmt: skip
FP8, OVERLAP = ["--optimizer.momentum_dtype", "fp8"], ["--optimizer.overlap"]


@pytest.mark.parametrize(
    "mode, features",
    [("async", FP8), ("async", OVERLAP), ("async_with_pinned_mem", [*FP8, *OVERLAP])],
    ids=["fp8-momentum", "overlap", "pinned-mem-fp8-overlap"],
)
def test_async_checkpoint_resumes_exactly(workdir, mode, features):
    """fp8 momentum (codes and per-row exponents) and overlap (momentum held on each matrix's owner,
    gathered back into per-parameter shards by a collective inside state_dict(), which must
    finish before dcp.async_save returns; with "async_with_pinned_mem" the copy of what it built
    runs on a background thread during the next step's forward and backward): a run resumed
    from the async step-2 checkpoint logs the uninterrupted run's losses at steps 3 and 4 bit
    for bit."""
    flags = [*ASYNC_EVERY_2, "--checkpoint.async_mode", mode, *features]
    dump = f"async_{mode}_" + "_".join(f.removeprefix("--optimizer.") for f in features)
    run_training_with_timeout(MUON, tiny(workdir, dump, *flags))
    straight = read_losses(str(workdir / dump))
    resumed = resume_from(workdir / dump, workdir, f"{dump}_resumed", 2, flags)
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: straight[step] for step in resumed}
    saved = read_checkpoint(str(workdir / dump / "checkpoint" / "step-2"))
    if "fp8" in features:  # the option took effect: fp8 codes saved, no fp32 momentum
        assert any(k.endswith("momentum_fp8") for k in saved) and not any(k.endswith("momentum_buffer") for k in saved)
    else:  # the owners' momentum was saved per parameter
        assert saved["optimizer/state.layers.0.attention.wq.weight.momentum_buffer"].shape == (64, 64)
    if "--optimizer.overlap" in features:  # overlap sent gradients during backward
        assert all(v > 0 for v in read_scalars(str(workdir / dump), "muon/rounds_sent_in_backward").values())


FLOAT8 = [
    "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]  # fmt: skip


def test_float8_training_trains_and_resumes_exactly(reference, workdir):
    """torchtitan's float8 converter (torchao Float8Linear, tensorwise scales, float8 all-gather in
    FSDP2, scales precomputed after each optimizer step; emulated float8 matmuls on the CPU):
    Muon's hidden matrices and the AdamW output head are float8-wrapped DTensors, and MuonClip
    (tau 0.05: every step clips) rescales wq / wk rows through the wrapper. The loss falls, the
    clipped heads' logits fall, and a run resumed from step 4 continues bit for bit.
    tests/test_float8_distributed.py checks the step itself against the unconverted model."""
    flags = [*FLOAT8, "--optimizer.qk_clip_tau", "0.05"]
    run_training_with_timeout(MUON, tiny(workdir, "float8", *flags, *CHECKPOINT_AT_RESUME_STEP))
    losses = read_losses(str(workdir / "float8"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    # step 1 runs the initial weights: float8 casts change its loss (so the converter ran), a little
    assert losses[1] != read_losses(str(reference))[1]
    assert losses[1] == pytest.approx(read_losses(str(reference))[1], rel=1e-2)
    # The max logit starts at 0.139 and stays 0.12-0.14 without clipping (measured); a clip written into
    # the float8-wrapped weights brings it to tau = 0.05, and one Muon step moves it to 0.058-0.065.
    max_logit = read_scalars(str(workdir / "float8"), "qk_clip/max_logit")
    assert all(v > 0 for v in read_scalars(str(workdir / "float8"), "qk_clip/heads_clipped").values())
    assert all(max_logit[step] < 0.6 * max_logit[1] for step in range(2, STEPS + 1)), max_logit
    resumed = resume_from(workdir / "float8", workdir, "float8_resumed", RESUME_STEP, [*flags, "--checkpoint.enable"])
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: losses[step] for step in resumed}
