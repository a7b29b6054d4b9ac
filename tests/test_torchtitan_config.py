"""The TorchTitan adapter in one process: config fields, optimizer container, data, checks."""

import os
from pathlib import Path

import pytest
import torch
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import Transformer

import titan_muon.torchtitan  # noqa: F401  (registers specs and datasets)
from titan_muon.torchtitan.checkpoint import CheckpointError, checkpoint_to_resume, interrupted_saves
from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.data import ensure_offline_tokenizer, read_text_files
from titan_muon.torchtitan.metrics import measure_logged_steps_only, note_logged_step, optimizer_metrics
from titan_muon.torchtitan.v022.optimizer import MuonOptimizersContainer
from titan_muon.torchtitan.v022.specs import LLAMA3_FLAVORS

REPO = Path(__file__).resolve().parents[1]
MUON_TOML = str(REPO / "train_configs" / "llama3_gqa_muon.toml")


def parse(*args: str, toml: str = MUON_TOML):
    return ConfigManager().parse_args(["--job.config_file", toml, *args])


def test_toml_and_cli_reach_the_optimizer_section():
    config = parse("--optimizer.ns_steps", "3", "--optimizer.adamw_patterns", "layers.0.*,norm.weight")
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.lr, optimizer.momentum) == ("Muon", 0.02, 0.95)
    assert optimizer.ns_steps == 3
    assert optimizer.adamw_patterns == ["layers.0.*", "norm.weight"]
    assert optimizer.beta2 == 0.95  # torchtitan's own fields are still there
    validate_optimizer_config(optimizer)


def test_hierarchical_exchange_reaches_muon():
    from titan_muon.torchtitan.v022.optimizer import muon_kwargs

    config = parse("--optimizer.hierarchical_exchange", "on", "--optimizer.ranks_per_node", "4").optimizer
    validate_optimizer_config(config)
    kwargs = muon_kwargs(config)
    assert (kwargs["hierarchical_exchange"], kwargs["ranks_per_node"]) == (True, 4)
    assert muon_kwargs(parse().optimizer)["hierarchical_exchange"] == "auto"


def test_keep_reservation_reaches_muon():
    from titan_muon.torchtitan.v022.optimizer import muon_kwargs

    for value, expected in (("on", True), ("off", False), ("auto", None)):
        config = parse("--optimizer.keep_reservation", value).optimizer
        validate_optimizer_config(config)
        assert muon_kwargs(config)["keep_reservation"] is expected
    assert muon_kwargs(parse().optimizer)["keep_reservation"] is None


def test_unknown_optimizer_key_is_named(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text(Path(MUON_TOML).read_text().replace("ns_steps = 5", "ns_step = 5"))
    with pytest.raises(ValueError, match="ns_step"):
        parse(toml=str(toml))


@pytest.mark.parametrize(
    "line, key",
    [
        ('ns_dtype = "fp8"', "ns_dtype"),
        ('comm_dtype = "fp16"', "comm_dtype"),
        ('momentum_dtype = "fp16"', "momentum_dtype"),
        ("ns_steps = 0", "ns_steps"),
        ("momentum = 1.5", "momentum"),
        ('adamw_patterns = "layers.*"', "adamw_patterns"),
        ('name = "Lion"', "name"),
        ('implementation = "apex"', "implementation"),
        ('hierarchical_exchange = "yes"', "hierarchical_exchange"),
        ("ranks_per_node = 0", "ranks_per_node"),
    ],
)
def test_invalid_optimizer_value_is_named(tmp_path, line, key):
    text = Path(MUON_TOML).read_text().replace("[optimizer]\n", f"[optimizer]\n{line}\n", 1)
    text = "\n".join(row for row in text.splitlines() if not (row.split("=")[0].strip() == key and row != line))
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ValueError, match=rf"\[optimizer\] {key}"):
        validate_optimizer_config(parse(toml=str(toml)).optimizer)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--optimizer.no-demo_shared_momentum",), r"\[optimizer\] demo = true with demo_shared_momentum = false needs nesterov = false"),
        (("--optimizer.no-nesterov", "--optimizer.demo_chunk", "0"), r"\[optimizer\] demo_chunk"),
        (("--optimizer.no-nesterov", "--optimizer.demo_topk", "5000"), r"\[optimizer\] demo_topk"),
        (("--optimizer.no-nesterov", "--optimizer.demo_alpha", "2"), r"\[optimizer\] demo_alpha"),
        (("--optimizer.demo_compressor", "low_rank", "--optimizer.demo_rank", "0"), r"\[optimizer\] demo_rank"),
        (("--optimizer.momentum_dtype", "bf16"), r"\[optimizer\] momentum_dtype"),
        (("--optimizer.overlap",), r"\[optimizer\] demo = true does not support overlap"),
        (("--optimizer.no-nesterov", "--optimizer.name", "AdamW", "--optimizer.no-qk_clip"), r'demo = true needs name = "Muon"'),
    ],
)
def test_demo_settings_are_checked(flags, message):
    optimizer = parse("--optimizer.demo", *flags).optimizer
    with pytest.raises(ValueError, match=message):
        validate_optimizer_config(optimizer)


def test_demo_keys_reach_the_optimizer():
    from titan_muon.torchtitan.v022.optimizer import muon_kwargs

    optimizer = parse("--optimizer.demo", "--optimizer.no-nesterov", "--optimizer.demo_topk", "4", "--optimizer.no-demo_shared_momentum").optimizer
    validate_optimizer_config(optimizer)
    kwargs = muon_kwargs(optimizer)
    assert (kwargs["demo"], kwargs["demo_chunk"], kwargs["demo_topk"], kwargs["demo_alpha"]) == (True, 64, 4, 1.0)
    assert kwargs["demo_shared_momentum"] is False
    assert (kwargs["demo_compressor"], kwargs["demo_rank"], kwargs["demo_adamw"]) == ("dct", 4, "sign")  # the defaults
    flags = ("--optimizer.demo", "--optimizer.demo_compressor", "low_rank", "--optimizer.demo_rank", "8", "--optimizer.demo_adamw", "dense")
    low_rank = muon_kwargs(parse(*flags).optimizer)
    assert (low_rank["demo_compressor"], low_rank["demo_rank"], low_rank["demo_adamw"]) == ("low_rank", 8, "dense")


def test_demo_is_one_switch_on_the_shipped_config(tmp_path):
    """``--optimizer.demo`` on the shipped Muon config (momentum 0.95, nesterov = true, fp32
    momentum) is valid as it is: the shared momentum is the config's Nesterov momentum. The same
    in the TOML (``demo = true``). Only a setting made explicitly against DeMo is refused, by name."""
    from titan_muon.torchtitan.v022.optimizer import muon_kwargs

    optimizer = parse("--optimizer.demo").optimizer
    validate_optimizer_config(optimizer)
    kwargs = muon_kwargs(optimizer)
    assert kwargs["demo"] and kwargs["demo_shared_momentum"] and kwargs["nesterov"] and kwargs["momentum_dtype"] == "fp32"
    toml = tmp_path / "demo.toml"
    text = Path(MUON_TOML).read_text()
    assert text.count("\ndemo = false ") == 1
    toml.write_text(text.replace("\ndemo = false ", "\ndemo = true ", 1))
    from_toml = parse(toml=str(toml)).optimizer
    assert from_toml.demo
    validate_optimizer_config(from_toml)
    with pytest.raises(ValueError, match=r"\[optimizer\] momentum_dtype"):
        validate_optimizer_config(parse("--optimizer.demo", "--optimizer.momentum_dtype", "bf16").optimizer)


def test_demo_parallelizes_without_replicas():
    """With demo = true the train spec's parallelize sees no replicate dimension (FSDP2 on the
    fsdp mesh only, no DDP); without it, torchtitan's own ParallelDims passes through."""
    from torchtitan.distributed import ParallelDims

    from titan_muon.torchtitan.replicas import parallelize_for_demo

    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=4)
    seen = []
    parallelize = parallelize_for_demo(lambda model, parallel_dims, job_config: seen.append(parallel_dims))
    parallelize(None, dims, parse())
    parallelize(None, dims, parse("--optimizer.demo", "--optimizer.no-nesterov"))
    assert seen[0] is dims
    view = seen[1]
    assert (view.dp_replicate, view.dp_replicate_enabled, view.dp_shard, view.fsdp_enabled) == (1, False, 2, True)
    assert view.fsdp_gradient_divide_factor == 2 and view.dp_enabled
    one_shard = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    parallelize(None, one_shard, parse("--optimizer.demo", "--optimizer.no-nesterov"))
    assert not seen[2].dp_replicate_enabled and not seen[2].fsdp_enabled and not seen[2].dp_enabled
    with pytest.raises(ValueError, match="data_parallel_replicate_degree >= 2"):
        parallelize(None, ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2),
                    parse("--optimizer.demo", "--optimizer.no-nesterov"))  # fmt: skip


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_qk_clip_with_another_optimizer_is_refused(name):
    optimizer = parse("--optimizer.name", name, "--optimizer.qk_clip").optimizer
    assert optimizer.qk_clip and optimizer.name == name
    with pytest.raises(ValueError, match=rf'\[optimizer\] qk_clip = true needs name = "Muon", got name = {name!r}'):
        validate_optimizer_config(optimizer)
    optimizer.qk_clip = False
    validate_optimizer_config(optimizer)


def test_qk_clip_under_context_parallel_reduces_over_the_cp_ranks():
    """Context parallel is recorded (tests/test_clip_context_parallel.py), no longer refused; the
    reduction group without pipeline parallel is the world, which holds every CP rank."""
    from torchtitan.distributed import ParallelDims

    from titan_muon.torchtitan.qk_clip import context_parallel_sequence, qk_clip_group

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, ep=1, etp=1, world_size=2)
    assert qk_clip_group(dims) is None  # checked without building a mesh: no collective
    no_cp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    assert context_parallel_sequence(no_cp) is None


def test_muon_without_config_module_is_explained(tmp_path):
    toml = tmp_path / "plain.toml"
    toml.write_text(
        '[job]\ndump_folder = "x"\n[model]\nname = "titan_muon_llama3"\n[optimizer]\nname = "Muon"\n'
    )
    with pytest.raises(ValueError, match="custom_config_module"):
        validate_optimizer_config(parse(toml=str(toml)).optimizer)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(LLAMA3_FLAVORS["tiny_gqa"])
    with torch.no_grad():
        model.init_weights()
    return model


def test_container_splits_muon_and_adamw_and_follows_the_lr_schedule():
    config = parse(
        "--optimizer.adamw_lr", "0.004", "--optimizer.adamw_patterns", "layers.0.feed_forward.*",
        "--optimizer.momentum_dtype", "bf16", "--optimizer.implementation", "foreach",
    )  # fmt: skip
    model = tiny_llama()
    container = MuonOptimizersContainer([model], config.optimizer)
    (optimizer,) = container.optimizers
    assert optimizer.adamw_implementation == "foreach"  # torchtitan's key reaches the AdamW groups
    groups = {group["use_muon"]: group for group in optimizer.param_groups}
    muon_names, adamw_names = set(groups[True]["param_names"]), set(groups[False]["param_names"])
    assert "layers.1.attention.wk.weight" in muon_names
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.feed_forward.w1.weight"} <= adamw_names
    assert (groups[True]["lr"], groups[False]["lr"]) == (0.02, 0.004)

    schedulers = build_lr_schedulers(container, config.lr_scheduler, training_steps=10)
    tokens = torch.randint(0, 2048, (2, 16))
    for _ in range(2):
        container.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        container.step()
        schedulers.step()
    assert groups[True]["lr"] / 0.02 == pytest.approx(groups[False]["lr"] / 0.004)
    assert set(optimizer_metrics(container)) >= {"muon/update_rms", "muon/bytes_sent"}

    state = container.state_dict()  # torchtitan's flattened DCP form
    assert "state.layers.1.attention.wq.weight.momentum_buffer" in state
    assert "state.output.weight.exp_avg_sq" in state


def test_update_rms_is_measured_in_the_steps_torchtitan_logs(monkeypatch):
    """The container's hooks (0.2.2's build_optimizers and 0.3.0's container apply them) and the
    metrics processor's log: with log_freq 3, torchtitan logs steps 1, 3, 6 and 9."""
    from types import SimpleNamespace

    from torchtitan.components.metrics import MetricsProcessor

    from titan_muon.torchtitan.metrics import OptimizerMetricsProcessor

    monkeypatch.setattr(MetricsProcessor, "log", lambda self, *args, **kwargs: None)  # torchtitan's own logging
    model = tiny_llama()
    container = MuonOptimizersContainer([model], parse().optimizer)
    measure_logged_steps_only(container)
    processor = OptimizerMetricsProcessor.__new__(OptimizerMetricsProcessor)
    processor.job_config, processor.optimizers = SimpleNamespace(metrics=SimpleNamespace(log_freq=3)), container
    tokens = torch.randint(0, 2048, (2, 16))
    measured = []
    for step in range(1, 10):
        container.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        container.step()
        measured.append("muon/update_rms" in optimizer_metrics(container))
        if processor.should_log(step):
            processor.log(step, 1.0, 1.0, 1.0)
    assert measured == [True, False, True, False, False, True, False, False, True]
    # a log that does not come (step 3 here): every step measures until the next one
    note_logged_step(container, 1, lambda step: step == 3)
    for expected in (False, True, True, True):
        container.step()
        assert ("muon/update_rms" in optimizer_metrics(container)) == expected


def test_text_files_split_is_fixed_and_disjoint(tmp_path):
    for i in range(60):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "skipped.py").write_text("skipped = True\n")
    train = read_text_files(str(tmp_path), (".py",), "train")
    validation = read_text_files(str(tmp_path), (".py",), "validation")
    assert len(train) + len(validation) == 60 and not set(train) & set(validation)
    assert train == read_text_files(str(tmp_path), (".py",), "train")
    assert "skipped = True\n" not in train


def test_offline_tokenizer_is_deterministic_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"f{i}.py").write_text(f"def function_{i}(value):\n    return value * {i} + len('{i}')\n" * 5)
    first, second = tmp_path / "a", tmp_path / "b"
    ensure_offline_tokenizer(str(first), str(corpus), (".py",), vocab_size=300)
    ensure_offline_tokenizer(str(second), str(corpus), (".py",), vocab_size=300)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    stamp = os.path.getmtime(first / "tokenizer.json")
    ensure_offline_tokenizer(str(first), str(corpus), (".py",), vocab_size=300)
    assert os.path.getmtime(first / "tokenizer.json") == stamp


def test_incomplete_newest_checkpoint_is_skipped_but_named(tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    assert checkpoint_to_resume(str(tmp_path), load_step=-1) == (20, str(tmp_path / "step-20"))
    assert interrupted_saves(str(tmp_path), resume_step=20) == [str(tmp_path / "step-30")]
    with pytest.raises(CheckpointError, match="step-30 is incomplete"):
        checkpoint_to_resume(str(tmp_path), load_step=30)  # asked for by name: refused
    assert checkpoint_to_resume(str(tmp_path), load_step=20) == (20, str(tmp_path / "step-20"))
    (tmp_path / "step-30").rmdir()
    (tmp_path / "step-5").mkdir()  # an older leftover (say, an interrupted purge) is ignored
    assert checkpoint_to_resume(str(tmp_path), load_step=-1) == (20, str(tmp_path / "step-20"))
    assert interrupted_saves(str(tmp_path), resume_step=20) == []
    assert checkpoint_to_resume(str(tmp_path / "absent"), load_step=-1) is None


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw", "spectral_unclamped"])
def test_every_adjust_lr_fn_is_accepted_from_toml_and_cli_and_reaches_muon(tmp_path, adjust_lr_fn):
    from titan_muon import Muon
    from titan_muon.torchtitan.v022.optimizer import muon_kwargs

    toml = tmp_path / "adjust.toml"
    toml.write_text(Path(MUON_TOML).read_text().replace('adjust_lr_fn = "original"', f'adjust_lr_fn = "{adjust_lr_fn}"'))
    for config in (parse(toml=str(toml)).optimizer, parse("--optimizer.adjust_lr_fn", adjust_lr_fn).optimizer):
        validate_optimizer_config(config)
        assert muon_kwargs(config)["adjust_lr_fn"] == adjust_lr_fn
    opt = Muon([torch.nn.Parameter(torch.randn(4, 8))], adjust_lr_fn=adjust_lr_fn)
    assert opt.param_groups[0]["adjust_lr_fn"] == adjust_lr_fn


def test_demo_adamw_choice_is_checked_in_toml(tmp_path):
    """A TOML demo_adamw outside the choices is refused naming the key (tyro checks the command line)."""
    toml = tmp_path / "bad_adamw.toml"
    toml.write_text(Path(MUON_TOML).read_text().replace("\ndemo = false ", '\ndemo = true\ndemo_adamw = "topk"\n#', 1))
    with pytest.raises(ValueError, match=r"\[optimizer\] demo_adamw"):
        validate_optimizer_config(parse(toml=str(toml)).optimizer)


def test_launcher_ends_the_process_only_after_a_successful_run_has_closed(monkeypatch):
    # titan_muon/torchtitan/teardown.py: the launched trainer skips the teardown where a rank now
    # and then aborted, but only once the run succeeded and closed; a failed run must tear down
    # as usual so its error reaches torchrun.
    from titan_muon.torchtitan.v022 import trainer as v022_trainer

    events = []
    monkeypatch.setattr(v022_trainer, "exit_now", lambda: events.append("exit"))
    monkeypatch.setattr(v022_trainer.Trainer, "close", lambda self: events.append("close"))

    def failing_train(self):
        raise RuntimeError("step 3 failed")

    monkeypatch.setattr(v022_trainer.Trainer, "train", failing_train)
    failed = object.__new__(v022_trainer.LauncherTrainer)  # the stock trainer's __init__ needs a job
    with pytest.raises(RuntimeError, match="step 3 failed"):
        failed.train()
    failed.close()
    assert events == ["close"]

    events.clear()
    monkeypatch.setattr(v022_trainer.Trainer, "train", lambda self: events.append("train"))
    finished = object.__new__(v022_trainer.LauncherTrainer)
    finished.train()
    finished.close()
    assert events == ["train", "close", "exit"]
