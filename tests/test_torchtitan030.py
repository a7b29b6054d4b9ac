"""titan_muon's torchtitan 0.3.0 adapter (titan_muon.torchtitan.v030), on CPU/gloo.

Runs only where torchtitan 0.3 is installed (skipped otherwise, with the reason); see
docs/torchtitan.md, "torchtitan 0.3.0", for the environment and the command:

    python -m venv --system-site-packages /work/venv030
    /work/venv030/bin/pip install torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 safetensors==0.8.0 --no-deps
    PYTHONPATH=. /work/venv030/bin/python -m pytest tests/test_torchtitan030.py

The runs go through ``torchrun -m titan_muon.train`` (which picks the 0.3 adapter) with a train_configs/ TOML
file and the suite's usual flags (0.2.2 names, translated by the launcher): a tiny model,
64-token sequences, 2 ranks, each launch with a timeout.
"""

import re
import shutil
from pathlib import Path

import pytest

from titan_muon.torchtitan.version import installed_torchtitan, uses_config_functions

if not uses_config_functions():
    installed = installed_torchtitan()
    pytest.skip(
        f"needs torchtitan 0.3 (installed: {installed}); run with the 0.3.0 environment of docs/torchtitan.md",
        allow_module_level=True,
    )

from dataclasses import fields  # noqa: E402

from distributed import tiny_run_flags, trainer_flags  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from torchtitan.config import ConfigManager, apply_overrides  # noqa: E402

from titan_muon.torchtitan import config as optimizer_section  # noqa: E402
from titan_muon.torchtitan.data import (  # noqa: E402
    PYTHON_FILES,
    STDLIB_DIR,
    ensure_offline_tokenizer,
)
from titan_muon.torchtitan.launch import (  # noqa: E402
    REPO_ROOT,
    finish,
    log_tail,
    read_losses,
    read_scalars,
    start,
    torchrun_command,
)
from titan_muon.torchtitan.v030.launch import parse  # noqa: E402
from titan_muon.torchtitan.v030.optimizer import MuonOptimizersContainer  # noqa: E402
from titan_muon.torchtitan.v030.trainer import check_supported  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

MUON = "train_configs/llama3_gqa_muon.toml"
MOE = "train_configs/moe_mla_muon.toml"
NO_QK_CLIP = "--optimizer.no-qk_clip"  # MuonClip is not supported with torchtitan 0.3.0 yet
STEPS, RESUME_STEP = 8, 4
RUN_TIMEOUT = 300  # seconds; a run takes ~15 s on an idle 2-core machine
ENTRY = ("-m", "titan_muon.train")  # the same launcher as on 0.2.2; it picks the 0.3 adapter
CHECKPOINT_AT_RESUME_STEP = [
    "--checkpoint.enable", "--checkpoint.interval", str(RESUME_STEP), "--checkpoint.no-last-save-model-only",
]  # fmt: skip


def train(config: str | None, overrides: list[str], nproc: int = 2) -> str:
    """Run to completion under torchrun; the log (rank 0), or an error with its tail.
    ``config``: a TOML file, or None when ``overrides`` hold ``--module`` / ``--config``."""
    command = torchrun_command(config or "", overrides, nproc, entry=ENTRY)
    if config is None:
        at = command.index("--job.config_file")
        del command[at : at + 2]
    result = finish(start(command), RUN_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"training failed (exit {result.returncode}):\n{log_tail(result)}")
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("torchtitan030")
    # the runs share one offline tokenizer; trained here once rather than by two ranks at once
    ensure_offline_tokenizer(str(workdir / "tokenizer"), STDLIB_DIR, PYTHON_FILES, 2048)
    return workdir


def tiny(workdir: Path, dump: str, *extra: str, steps: int = STEPS, flavor: str = "tiny_gqa") -> list[str]:
    return [*tiny_run_flags(workdir, dump, steps, flavor), *trainer_flags(), NO_QK_CLIP, *extra]


# ---------------------------------------------------------------- configuration, no run


def test_muon_config_has_the_022_optimizer_keys():
    ours = {f.name for f in fields(MuonOptimizersContainer.Config)}
    section = {f.name for f in fields(optimizer_section.Optimizer)}
    assert section | {"lr", "weight_decay", "beta1", "beta2", "eps", "implementation"} <= ours


def test_one_override_switches_a_stock_recipe_to_muon():
    argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
            'titan_muon.torchtitan.v030.optimizer.muon={"ns_steps": 3}']  # fmt: skip
    config = ConfigManager().parse_args(argv)
    apply_overrides(config.override, config)  # what torchtitan's Trainer does first
    assert isinstance(config.optimizer, MuonOptimizersContainer.Config)
    assert config.optimizer.ns_steps == 3
    assert config.optimizer.adamw_lr == 8e-4  # the recipe's AdamW settings go to Muon's AdamW groups
    assert (config.optimizer.beta1, config.optimizer.beta2, config.optimizer.eps) == (0.9, 0.95, 1e-8)


@pytest.mark.parametrize("name", ["llama3_gqa_muon", "llama3_gqa_adamw", "mla_muon", "moe_mla_muon"])
def test_every_shipped_toml_builds_a_030_config(name):
    config = parse(["--job.config_file", f"train_configs/{name}.toml", "--optimizer.qk_clip", "false"])
    muon = name.endswith("muon")
    assert isinstance(config.optimizer, MuonOptimizersContainer.Config) == muon
    assert config.model_spec.name == ("llama3" if name.startswith("llama3") else "deepseek_v3")
    assert config.training.steps == 300 and config.training.seq_len == 256
    if muon:
        assert config.optimizer.split == "head" and config.optimizer.adamw_lr == 0.003
    check_supported(config)


def test_qk_clip_is_refused_by_name():
    config = parse(["--job.config_file", MUON])  # the file sets qk_clip = true
    with pytest.raises(ValueError, match="no-qk_clip"):
        check_supported(config)


def test_unknown_toml_key_is_refused(tmp_path):
    text = (REPO_ROOT / MUON).read_text().replace("[training]", "[training]\nno_such_key = 1", 1)
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ValueError, match="no_such_key"):
        parse(["--job.config_file", str(tmp_path / "bad.toml")])


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """2 ranks, 8 steps of Muon on the stdlib corpus, checkpoints at steps 4 and 8."""
    train(MUON, tiny(workdir, "reference", *CHECKPOINT_AT_RESUME_STEP))
    return workdir / "reference"


def one_sequence_corpus(workdir: Path, seq_len: int = 64) -> Path:
    """Text files that each tokenize to one training sequence, all the same: the loss must fall."""
    tokenizer = Tokenizer.from_file(str(workdir / "tokenizer" / "tokenizer.json"))
    source = (REPO_ROOT / "titan_muon" / "torchtitan" / "data.py").read_text()
    text = next(source[:n] for n in range(1, len(source)) if len(tokenizer.encode(source[:n]).ids) == seq_len - 1)
    corpus = workdir / "one_sequence"
    corpus.mkdir(exist_ok=True)
    for i in range(40):
        (corpus / f"copy_{i}.txt").write_text(text)
    return corpus


def test_two_rank_run_loss_falls_and_muon_metrics_are_logged(workdir):
    data = ["--training.dataset", "text_files", "--training.dataset_path", str(one_sequence_corpus(workdir))]
    train(MUON, tiny(workdir, "one_sequence", *data))
    losses = read_losses(str(workdir / "one_sequence"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[step + 1] < losses[step] for step in range(2, STEPS)), losses
    assert losses[STEPS] < losses[1] - 0.5, losses
    for tag in ("grad_norm", "muon/update_rms", "muon/bytes_sent", "muon/step_time_ms", "optimizer/step_time_ms"):
        values = read_scalars(str(workdir / "one_sequence"), tag)
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        assert all(value > 0 for value in values.values()), tag


def test_resume_from_dcp_checkpoint_continues_exactly(reference, workdir):
    target = workdir / "resumed" / "checkpoint" / f"step-{RESUME_STEP}"
    shutil.copytree(reference / "checkpoint" / f"step-{RESUME_STEP}", target)
    log = train(MUON, tiny(workdir, "resumed", *CHECKPOINT_AT_RESUME_STEP))
    assert f"Loading the checkpoint from {target}" in log
    straight, resumed = read_losses(str(reference)), read_losses(str(workdir / "resumed"))
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}  # bit for bit


def test_moe_experts_are_all_muon_parameters(workdir):
    """MLA + MoE (tiny_moe: 6 routed experts split over 2 expert-parallel ranks), with the TOML's
    fp8 momentum and backward overlap: the build log puts every routed expert stack in Muon."""
    log = train(MOE, tiny(workdir, "moe", "--parallelism.expert_parallel_degree", "2", steps=3, flavor="tiny_moe"))
    rows = [line.split() for line in log.splitlines() if re.match(r"(Muon|AdamW)\s", line)]
    experts = [row for row in rows if "routed_experts" in row[-1]]
    assert {row[-1].rsplit(".", 1)[1] for row in experts} == {"w1_EFD", "w2_EDF", "w3_EFD"}, rows
    assert all(row[0] == "Muon" and "expert" in row[1:3] for row in experts), experts
    assert all(row[0] == "AdamW" for row in rows if "router" in row[-1]), rows
    losses = read_losses(str(workdir / "moe"))
    assert sorted(losses) == [1, 2, 3]


def test_stock_recipe_trains_with_the_muon_override(workdir):
    """torchtitan's own llama3_debugmodel recipe, its optimizer replaced by one --override.imports flag
    (and pointed at the offline data and tokenizer, as the recipe's test assets are not installed)."""
    log = train(None, [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--override.imports", "titan_muon.torchtitan.v030.optimizer.muon",
        "--dataloader.dataset", "python_stdlib", "--hf_assets_path", str(workdir / "tokenizer"),
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "2",
        "--dump_folder", str(workdir / "stock"), "--metrics.disable_color_printing",
    ])  # fmt: skip
    assert "[Override] titan_muon.torchtitan.v030.optimizer.muon: optimizer" in log
    assert re.search(r"Muon\s+hidden matrix\s+768x256\s+6\s+layers\.\*\.attention\.qkv_linear\.wqkv\.weight", log)
    assert "step:  2  loss:" in log
