"""titan_muon's torchtitan 0.3.0 adapter (titan_muon.torchtitan.v030), on CPU/gloo.

Runs only where torchtitan 0.3 is installed (skipped otherwise, with the reason); see
docs/torchtitan.md, "torchtitan 0.3.0", for the environment and the command:

    python -m venv --system-site-packages /work/venv030
    /work/venv030/bin/pip install torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 safetensors==0.8.0 --no-deps
    PYTHONPATH=. /work/venv030/bin/python -m pytest tests/test_torchtitan030.py

The runs go through ``torchrun -m titan_muon.train`` (which picks the 0.3 adapter) with a train_configs/ TOML
file and the suite's usual flags (0.2.2 names, translated by the launcher): a tiny model,
64-token sequences, 2 ranks (4 for the parallel layouts: PP 2 x FSDP 2, TP 2 x FSDP 2, HSDP 2 x 2,
each compared with FSDP 2 from the same seed checkpoint), each launch with a timeout. MuonClip is on
as the TOML files set it. Two one-rank launches with --nnodes 2 train as one launch of 2 ranks; one run of
mla_muon.toml shows split = "fine", overlap, fp8 momentum and MuonClip at work, and a NaN gradient
(tests/fixtures/fault_train030.py) skipped with nonfinite_grads = "skip".

MuonClip's recording is also checked in one process on 0.3.0's own attention modules (llama3 with
fused or separate q/k/v, deepseek_v3 MLA; SDPA, and FlexAttention with its packed-document mask):
the recorded max equals the max of the logits that reproduce the attention's output, and a clip
brings the clipped heads to tau on a re-recording. Under context parallel 2 (2 gloo ranks, 0.3.0's own
input sharding and CP wrapping of the inner attentions, an exact stand-in for the CP attention kernel,
which torch has no CPU version of) the recorded per-head maxima equal the one-process ones.
"""

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from titan_muon.torchtitan.version import installed_torchtitan, uses_config_functions

if not uses_config_functions():
    installed = installed_torchtitan()
    pytest.skip(
        f"needs torchtitan 0.3 (installed: {installed}); run with the 0.3.0 environment of docs/torchtitan.md",
        allow_module_level=True,
    )

from dataclasses import fields  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from distributed import (  # noqa: E402
    GatherAlongSequence,
    causal_mask_over_ranks,
    one_sequence_corpus,
    run_distributed,
    tiny_run_flags,
    trainer_flags,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.config import ConfigManager, apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.context_parallel import (  # noqa: E402
    apply_cp_to_forward,
    prepare_context_parallel_input,
)
from torchtitan.models.common.attention import FlexAttention  # noqa: E402

from titan_muon.attention.clip import QKClip  # noqa: E402
from titan_muon.attention.layers import find_attention_layers  # noqa: E402
from titan_muon.attention.logits import ContextParallelSequence  # noqa: E402
from titan_muon.attention.split import attention_row_blocks  # noqa: E402
from titan_muon.torchtitan import config as optimizer_section  # noqa: E402
from titan_muon.torchtitan.checkpoint import CheckpointError, check_before_resume  # noqa: E402
from titan_muon.torchtitan.data import (  # noqa: E402
    PYTHON_FILES,
    STDLIB_DIR,
    ensure_offline_tokenizer,
)
from titan_muon.torchtitan.harness import (  # noqa: E402
    finish,
    local_nodes_rendezvous,
    log_tail,
    read_checkpoint,
    read_losses,
    read_scalars,
    run_together,
    start,
    torchrun_command,
)
from titan_muon.torchtitan.qk_clip import use_context_parallel_load_balancer  # noqa: E402
from titan_muon.torchtitan.v030 import cpu  # noqa: E402
from titan_muon.torchtitan.v030.launch import parse  # noqa: E402
from titan_muon.torchtitan.v030.models import llama3_gqa, model_spec  # noqa: E402
from titan_muon.torchtitan.v030.optimizer import (  # noqa: E402
    MuonOptimizersContainer,
    is_pipeline_stage,
)
from titan_muon.torchtitan.v030.trainer import check_supported  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

MUON = "train_configs/llama3_gqa_muon.toml"
MOE = "train_configs/moe_mla_muon.toml"
STEPS, RESUME_STEP = 8, 4
CLIPPING = ["--optimizer.qk_clip_tau", "0.05"]  # tiny_gqa's max logits start near 0.12: every step clips
RUN_TIMEOUT = 300  # seconds; a run takes ~15 s on an idle 2-core machine
ENTRY = ("-m", "titan_muon.train")  # the same launcher as on 0.2.2; it picks the 0.3 adapter
CHECKPOINT_AT_RESUME_STEP = [
    "--checkpoint.enable", "--checkpoint.interval", str(RESUME_STEP), "--checkpoint.no-last-save-model-only",
]  # fmt: skip


def launch(config: str | None, overrides: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    """Run under torchrun, with a timeout. ``config``: a TOML file, or None when ``overrides`` hold
    ``--module`` / ``--config``."""
    command = torchrun_command(config or "", overrides, nproc, entry=ENTRY)
    if config is None:
        at = command.index("--job.config_file")
        del command[at : at + 2]
    return finish(start(command), RUN_TIMEOUT)


def train(config: str | None, overrides: list[str], nproc: int = 2) -> str:
    """Run to completion under torchrun; the log (rank 0), or an error with its tail."""
    result = launch(config, overrides, nproc)
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
    return [*tiny_run_flags(workdir, dump, steps, flavor), *trainer_flags(), *extra]


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


def test_the_recipes_adamw_weight_decay_stays_adamws():
    """The override carries the recipe's AdamW settings to Muon's AdamW groups only: its weight
    decay (0.05 here, not the Muon default 0.1, so the two can be told apart) becomes
    adamw_weight_decay, and Muon's weight decay stays its own (the default, or the override's)."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from titan_muon.torchtitan.muon import muon_kwargs, param_group_kwargs
    from titan_muon.torchtitan.v030.optimizer import muon

    adamw = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
    recipe = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)])
    replaced = muon(recipe)
    assert (param_group_kwargs(replaced)["adamw_weight_decay"], param_group_kwargs(replaced)["adamw_lr"]) == (0.05, 8e-4)
    assert muon_kwargs(replaced)["weight_decay"] == MuonOptimizersContainer.Config().weight_decay == 0.1
    assert muon_kwargs(muon(recipe, weight_decay=0.2))["weight_decay"] == 0.2
    assert param_group_kwargs(muon(recipe, adamw_weight_decay=0.3))["adamw_weight_decay"] == 0.3  # the override's wins


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw", "spectral_unclamped"])
def test_every_adjust_lr_fn_of_distmuon_is_accepted(adjust_lr_fn):
    """torchtitan 0.3.0's DistMuon takes these three; so does the 0.3.0 container's config."""
    from titan_muon.torchtitan.v030.optimizer import check_config

    config = MuonOptimizersContainer.Config(adjust_lr_fn=adjust_lr_fn)
    check_config(config)
    argv = ["--job.config_file", MUON, "--optimizer.adjust_lr_fn", adjust_lr_fn]
    assert parse(argv).optimizer.adjust_lr_fn == adjust_lr_fn


@pytest.mark.parametrize("name", ["llama3_gqa_muon", "llama3_gqa_adamw", "mla_muon", "moe_mla_muon"])
def test_every_shipped_toml_builds_a_030_config(name):
    config = parse(["--job.config_file", f"train_configs/{name}.toml"])
    muon = name.endswith("muon")
    assert isinstance(config.optimizer, MuonOptimizersContainer.Config) == muon
    assert config.model_spec.name == ("llama3" if name.startswith("llama3") else "deepseek_v3")
    assert config.training.steps == 300 and config.training.seq_len == 256
    if muon:
        assert config.optimizer.split == "head" and config.optimizer.adamw_lr == 0.003
        assert config.optimizer.qk_clip and config.optimizer.qk_clip_tau == 100.0  # MuonClip, as with 0.2.2
    check_supported(config)


def test_qk_clip_is_refused_under_0_3_0_context_parallel_flex_and_with_cuda_graphs():
    check_supported(parse(["--job.config_file", MUON, "--parallelism.context_parallel_degree", "2"]))  # SDPA on CPU
    config = parse(["--job.config_file", MUON, "--parallelism.context_parallel_degree", "2"])
    config.model_spec.model.layers[0].attention.inner_attention = FlexAttention.Config()
    with pytest.raises(ValueError, match="context_parallel_degree = 2 and FlexAttention under torchtitan 0.3.0"):
        check_supported(config)
    config = parse(["--job.config_file", MUON, "--training.no-disable_cuda_graphs"])
    with pytest.raises(ValueError, match="qk_clip records max attention logits with Python hooks"):
        check_supported(config)
    check_supported(parse(["--job.config_file", MUON, "--training.no-disable_cuda_graphs", "--optimizer.no-qk_clip"]))


# ------------------------------------------------ MuonClip on 0.3.0's attention modules, one process


def attention_model(name: str, attention: str):
    """A tiny 0.3.0 model built from our flavors: llama3 with fused wqkv ("llama3") or separate wq/wk/wv
    ("llama3_unfused"), or deepseek_v3 MLA ("mla"); with SDPA or FlexAttention (eager here: CPU)."""
    torch.manual_seed(0)
    if name == "llama3_unfused":
        config = llama3_gqa(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, fuse_qkv=False)
    else:
        config = model_spec(*{"llama3": ("llama3", "tiny_gqa"), "mla": ("deepseek_v3", "tiny_dense")}[name]).model
    if attention == "sdpa":
        cpu.use_sdpa_attention(config)
    model = config.build()
    model.init_weights(buffer_device=None)
    return model


def batch(model, attention: str):
    """Tokens, and the forward's other arguments: with flex, positions that reset at document starts
    and the model's own packed-document BlockMask; with SDPA, causal over the whole sequence."""
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    if attention == "sdpa":
        return tokens, {}, None
    positions = torch.arange(64).repeat(2, 1)
    positions[0, 25:] -= 25  # sequence 0: documents [0, 25) and [25, 64)
    positions[1, 40:] -= 40  # sequence 1: [0, 40) and [40, 64)
    return tokens, {"positions": positions, "attention_masks": model.get_attention_masks(positions)}, positions


def forward(model, tokens, kwargs):
    with torch.no_grad():  # recording needs no graph; eager FlexAttention on CPU runs without one only
        return model(tokens, **kwargs)


def allowed_pairs(positions, length: int) -> torch.Tensor:
    """(B, 1, L, L): causal, and within a document when positions reset (computed here, not by torchtitan)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if positions is None:
        return causal[None, None]
    doc = torch.cumsum(positions == 0, dim=1)
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)


@pytest.mark.parametrize("name", ["llama3", "llama3_unfused", "mla"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_recorded_max_is_the_max_of_the_logits_softmax_sees(name, attention, eager_flex):
    model = attention_model(name, attention)
    qk_clip = QKClip(model)
    captured = []

    def capture(module, args, kwargs, output):
        captured.append((args, kwargs, output))

    for layer in model.layers.values():
        layer.attention.inner_attention.register_forward_hook(capture, with_kwargs=True)
    tokens, kwargs, positions = batch(model, attention)
    forward(model, tokens, kwargs)
    assert len(captured) == len(model.layers) == len(qk_clip.layers)
    for index, ((q, k, v), call, output) in enumerate(captured):
        assert (attention == "flex") == ("attention_masks" in call and call["attention_masks"] is not None)
        # the dense reference, in fp64, from the q and k the inner attention was given: (B, L, H, D)
        q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
        rep = q64.shape[1] // k64.shape[1]
        k64, v64 = k64.repeat_interleave(rep, dim=1), v64.repeat_interleave(rep, dim=1)
        scale = call.get("scale") or q.shape[-1] ** -0.5
        logits = (scale * q64 @ k64.transpose(-1, -2)).masked_fill(~allowed_pairs(positions, q.shape[1]), -math.inf)
        # these are the logits softmax saw: they reproduce the attention's output
        torch.testing.assert_close((logits.softmax(-1) @ v64).transpose(1, 2), output.double(), rtol=1e-4, atol=1e-5)
        expected = logits.amax(dim=(0, 2, 3))
        torch.testing.assert_close(qk_clip.recorder.max_logits[index].double(), expected, rtol=1e-5, atol=1e-6)


class GatheredCausalSDPA030:
    """The test's stand-in for the SDPA kernel that torch's context parallel runs on GPUs (none on CPU):
    exact causal attention of this rank's queries over every rank's keys and values, on 0.3.0's
    (B, L, heads, head_dim) inputs, masked by the global positions torchtitan gave this rank's tokens.
    It takes the place of the inner attention's own forward, which 0.3.0's ``apply_cp_to_forward``
    then wraps exactly as in a CP run (q, k, v made DTensors sharded along the sequence)."""

    def __init__(self, group, positions):
        self.group, self.allowed = group, causal_mask_over_ranks(group, positions)

    def __call__(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
        assert attention_masks is None and is_causal
        q, k, v = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, L, D)
        k, v = (GatherAlongSequence.apply(t, self.group) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _context_parallel_without_parallel_dims_030(rank, world):
    cpu.use_cpu_device()
    model = attention_model("llama3", "sdpa")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=world, tp=1, pp=1, ep=1, world_size=world)
    apply_cp_to_forward([block.attention.inner_attention for block in model.layers.values()], dims.get_mesh("cp"))
    optimizers = MuonOptimizersContainer(MuonOptimizersContainer.Config(qk_clip=True), model_parts=[model])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        optimizers.step()
        outcome = ""
    except RuntimeError as error:
        outcome = str(error)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return {"outcome": outcome, "unchanged": unchanged}


def test_context_parallel_without_the_parallel_dims_refuses_to_step():
    """A stock Trainer never hands the container the parallel dims: under context parallel the
    clips would record each rank's slice alone and miss the pairs across ranks. The container sees
    0.3.0's CP wrapping of the inner attentions and refuses to step, on every rank, before anything."""
    for result in run_distributed(_context_parallel_without_parallel_dims_030, 2, timeout=300.0):
        assert "needs the sequence layout" in result["outcome"] and "use_parallel_dims" in result["outcome"]
        assert result["unchanged"]


def _context_parallel_run_030(rank, world, name, load_balancer):
    cpu.use_cpu_device()
    model = attention_model(name, "sdpa")  # the same seeded weights on every rank
    tokens = batch(model, "sdpa")[0]  # (2, 64): the same whole sequences on every rank
    positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)

    # CP 1: the whole sequence in one process, recorded by a QKClip without context parallel.
    reference_clip = QKClip(model)
    reference_output = forward(model, tokens, {"positions": positions})
    reference_s = reference_clip.recorder.max_logits.clone()
    reference_clip.remove()

    # CP `world`: this rank's slice, cut by torchtitan 0.3.0; its CP wrapping of the inner attentions.
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=world, tp=1, pp=1, ep=1, world_size=world)
    cp_mesh = dims.get_mesh("cp")
    local_tokens, _, extra = prepare_context_parallel_input(
        tokens, tokens.clone(), {"positions": positions}, cp_mesh, torch.device("cpu"), load_balancer
    )
    inner = [block.attention.inner_attention for block in model.layers.values()]
    for module in inner:
        module.forward = GatheredCausalSDPA030(cp_mesh.get_group(), extra["positions"][0])
    apply_cp_to_forward(inner, cp_mesh)
    # As titan_muon's 0.3.0 trainer wires it: the container's clips rebuilt from the parallel dims,
    # then told the run's load balancer.
    optimizers = MuonOptimizersContainer(MuonOptimizersContainer.Config(qk_clip=True), model_parts=[model])
    optimizers.use_parallel_dims(dims)
    use_context_parallel_load_balancer(optimizers.qk_clips, load_balancer)
    (qk_clip,) = optimizers.qk_clips
    assert qk_clip.recorder.context_parallel == ContextParallelSequence(cp_mesh.get_group(), load_balancer)
    output = forward(model, local_tokens, extra)
    return {
        "reference_s": reference_s,
        "s": qk_clip.recorder.all_reduce().clone(),  # MAX over the CP ranks, as reduce_and_clip does
        "local_positions": extra["positions"][0],
        "reference_output": reference_output,
        "output": output,
    }


@pytest.mark.parametrize("name, load_balancer", [("llama3", "headtail"), ("mla", "headtail"), ("llama3", None)])
def test_context_parallel_records_as_one_process(name, load_balancer):
    """CP 2 on 0.3.0's own models, its sequence cut and its CP wrapping of the inner attentions:
    the per-head maxima recorded on the ranks' slices equal those of one process over the whole
    sequence. Only the attention kernel is the test's (see GatheredCausalSDPA030): torch 2.13's
    context-parallel SDPA has no CPU kernel, so a real 0.3.0 CP run cannot train on CPU."""
    results = run_distributed(_context_parallel_run_030, 2, name, load_balancer, timeout=300.0)
    for result in results:
        # The stand-in attention is exact: each rank's logits are the whole-sequence run's at its
        # positions (fp32; explicit mask vs is_causal kernel: rounding ~1e-7 relative per operation).
        expected_output = result["reference_output"][:, result["local_positions"]]
        torch.testing.assert_close(result["output"], expected_output, rtol=1e-4, atol=1e-5)
        # Every (layer, head) maximum: the same fp32 dot products of q and k rows that agree to
        # rounding (the layers before ran the two kernels above), well below 1e-5 relative for
        # these logits of O(0.1..1); a pair missed across ranks would change a maximum by far more.
        assert torch.isfinite(result["reference_s"]).all()
        torch.testing.assert_close(result["s"], result["reference_s"], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0]["s"], results[1]["s"])


@pytest.mark.parametrize("name, kind", [("llama3", "fused_wqkv"), ("llama3_unfused", "gqa"), ("mla", "mla")])
def test_split_clip_and_recorder_find_the_same_030_attention_layers(name, kind):
    """One finder (titan_muon.attention.layers) on 0.3.0's own modules: Split cuts, QK-clip scales and
    the recorder hooks exactly the layers and projections it reports."""
    model = attention_model(name, "sdpa")
    layers = find_attention_layers(model)
    assert [layer.kind for layer in layers] == [kind] * len(model.layers)
    blocks = attention_row_blocks(model)
    assert set(blocks) == {layer.weight_fqn(p) for layer in layers for p in layer.projection_names()}
    assert set(blocks) <= {n for n, _ in model.named_parameters()}
    qk_clip = QKClip(model)
    assert [(c.name, c.module) for c in qk_clip.layers] == [(f.name, f.module) for f in layers]
    assert qk_clip.recorder.layers == [layer.module for layer in layers]
    for layer in qk_clip.layers:
        assert model.get_parameter(layer.weight_fqn(layer.query_projection_name)) is layer.query_projection.weight
    qk_clip.remove()


@pytest.mark.parametrize("name", ["llama3", "llama3_unfused", "mla"])
def test_clipped_heads_are_at_tau_on_a_re_recording(name):
    """Record, clip (no optimizer step in between), run every attention again on the input it had: every
    clipped head's max logit is tau, every other head's unchanged bit for bit (its rows were multiplied by
    exactly 1). Each attention is re-run on its own recorded input, not the model on the tokens: a clip in
    one layer changes what the next layers receive."""
    model = attention_model(name, "sdpa")
    qk_clip = QKClip(model)
    inputs = []
    for layer in model.layers.values():
        layer.attention.register_forward_pre_hook(lambda module, args, kwargs: inputs.append((module, args, kwargs)),
                                                  with_kwargs=True)  # fmt: skip
    tokens, kwargs, _ = batch(model, "sdpa")
    forward(model, tokens, kwargs)
    before = qk_clip.recorder.max_logits.clone()
    qk_clip.tau = before.median().item()  # about half of the heads over tau
    metrics = qk_clip.reduce_and_clip(lr=1.0)  # resets the recording
    clipped = before > qk_clip.tau
    assert metrics["qk_clip/heads_clipped"] == clipped.sum() and 0 < clipped.sum() < clipped.numel()
    assert clipped.any(dim=1).all(), clipped  # in every layer
    with torch.no_grad():
        for attention, args, call in list(inputs):
            attention(*args, **call)
    after = qk_clip.recorder.max_logits
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], qk_clip.tau), rtol=1e-5, atol=0)
    assert torch.equal(after[~clipped], before[~clipped])


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """2 ranks, 8 steps of Muon on the stdlib corpus, MuonClip clipping every step, checkpoints at steps 4 and 8."""
    train(MUON, tiny(workdir, "reference", *CLIPPING, *CHECKPOINT_AT_RESUME_STEP))
    return workdir / "reference"


def test_two_rank_run_loss_falls_and_muon_metrics_are_logged(workdir):
    data = ["--training.dataset", "text_files", "--training.dataset_path", str(one_sequence_corpus(workdir, workdir / "tokenizer"))]
    train(MUON, tiny(workdir, "one_sequence", *data))
    losses = read_losses(str(workdir / "one_sequence"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[step + 1] < losses[step] for step in range(2, STEPS)), losses
    assert losses[STEPS] < losses[1] - 0.5, losses
    for tag in ("grad_norm", "muon/update_rms", "muon/bytes_sent", "muon/step_time_ms", "optimizer/step_time_ms",
                "qk_clip/max_logit", "qk_clip/max_logit/layers.0.attention", "qk_clip/max_logit/layers.1.attention"):
        values = read_scalars(str(workdir / "one_sequence"), tag)
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        assert all(value > 0 for value in values.values()), tag
    # MuonClip is on (the TOML's tau = 100, far above this model's logits): recorded, nothing clipped
    assert set(read_scalars(str(workdir / "one_sequence"), "qk_clip/heads_clipped").values()) == {0}


def test_shipped_toml_clips_with_a_low_tau(reference):
    """train_configs/llama3_gqa_muon.toml as shipped (qk_clip = true), tau 0.05: every step clips, on both
    ranks alike (one MAX all-reduce), and the clip pulls the max logit back towards tau: step 1 records the
    untouched initialization (~0.12); each later step records the weights its predecessor clipped to tau
    and then moved by one Muon update."""
    clipped = read_scalars(str(reference), "qk_clip/heads_clipped")
    max_logit = read_scalars(str(reference), "qk_clip/max_logit")
    assert sorted(clipped) == sorted(max_logit) == list(range(1, STEPS + 1))
    assert all(count > 0 for count in clipped.values()), clipped
    assert max_logit[1] > 2 * 0.05, max_logit
    assert all(max_logit[step] < max_logit[1] for step in range(2, STEPS + 1)), max_logit
    assert read_scalars(str(reference), "qk_clip/nonfinite_heads") == {step: 0 for step in range(1, STEPS + 1)}


def test_resume_from_dcp_checkpoint_continues_exactly(reference, workdir):
    """With MuonClip clipping every step: its state is the weights themselves, so resuming is exact."""
    target = workdir / "resumed" / "checkpoint" / f"step-{RESUME_STEP}"
    shutil.copytree(reference / "checkpoint" / f"step-{RESUME_STEP}", target)
    log = train(MUON, tiny(workdir, "resumed", *CLIPPING, *CHECKPOINT_AT_RESUME_STEP))
    assert f"Loading the checkpoint from {target}" in log
    straight, resumed = read_losses(str(reference)), read_losses(str(workdir / "resumed"))
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}  # bit for bit
    for tag in ("qk_clip/max_logit", "qk_clip/heads_clipped"):
        expected, got = read_scalars(str(reference), tag), read_scalars(str(workdir / "resumed"), tag)
        assert got == {step: expected[step] for step in resumed}, tag


def test_two_nodes_match_one_node(reference, workdir):
    """Two torchrun launches with --nnodes 2 and one rank each, c10d rendezvous on 127.0.0.1, training the
    shipped TOML through titan_muon's launcher with the reference run's flags (MuonClip clipping included)."""
    overrides = tiny(workdir, "two_nodes", *CLIPPING, *CHECKPOINT_AT_RESUME_STEP)
    command = torchrun_command(MUON, overrides, nproc=1, rdzv=local_nodes_rendezvous(2), entry=ENTRY)
    results = run_together(command, 2, timeout=RUN_TIMEOUT)
    assert [r.returncode for r in results] == [0, 0], "\n".join(log_tail(r, 4000) for r in results)
    # Bit for bit, as on 0.2.2: the same 2 ranks on the same FSDP mesh, the same thread count (torchrun sets
    # OMP_NUM_THREADS=1 only with several ranks per node; tests/conftest.py sets it for every launch), and a
    # run is deterministic (docs/reliability.md, "Portability"). Which launch becomes rank 0 does not matter:
    # both run the same command on the same machine. Nothing titan_muon plans depends on the node count at
    # 2 ranks (the hierarchical exchange needs more than 256), and MuonClip's MAX all-reduce is exact.
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "qk_clip/max_logit", "qk_clip/heads_clipped"):
        expected = read_scalars(str(reference), tag)
        assert sorted(expected) == list(range(1, STEPS + 1)), tag
        assert read_scalars(str(workdir / "two_nodes"), tag) == expected, tag


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_checkpoint_equals_the_synchronous_one_and_resumes_exactly(reference, workdir, mode):
    """[checkpoint] async_mode, as on 0.2.2 (tests/test_torchtitan_train.py): the reference run's flags
    with its saves asynchronous log the reference's losses and MuonClip metrics, write a step-4
    checkpoint equal to the reference's entry by entry, and a run resumed from it continues bit for bit.
    "async_with_pinned_mem" stages on a background thread while the next step runs and writes from a
    separate process; on the CPU without pinned memory (titan_muon.torchtitan.cpu.
    stage_checkpoints_without_accelerator)."""
    dump = f"async_{mode}"
    flags = [*CLIPPING, *CHECKPOINT_AT_RESUME_STEP, "--checkpoint.async_mode", mode]
    train(MUON, tiny(workdir, dump, *flags))
    for tag in ("loss_metrics/global_avg_loss", "qk_clip/max_logit"):
        assert read_scalars(str(workdir / dump), tag) == read_scalars(str(reference), tag), tag
    step = f"step-{RESUME_STEP}"
    got, expected = (read_checkpoint(str(folder / "checkpoint" / step)) for folder in (workdir / dump, reference))
    assert sorted(got) == sorted(expected)
    differ = [k for k, v in expected.items() if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]
    assert not differ, differ[:8]
    shutil.copytree(workdir / dump / "checkpoint" / step, workdir / f"{dump}_resumed" / "checkpoint" / step)
    train(MUON, tiny(workdir, f"{dump}_resumed", *flags))
    straight, resumed = read_losses(str(reference)), read_losses(str(workdir / f"{dump}_resumed"))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}  # bit for bit


def test_async_checkpoint_with_fp8_momentum_and_overlap_resumes_exactly(workdir):
    """fp8 momentum held on the owners (overlap), saved with "async_with_pinned_mem": state_dict()
    gathers each parameter's codes and exponents from the owners by a collective on the training
    thread, then the copy runs on a background thread during step 3's forward and backward (whose
    hooks send gradients to the owners). A run resumed from step 2 logs steps 3 and 4 bit for bit."""
    flags = [
        *CLIPPING, "--optimizer.momentum_dtype", "fp8", "--optimizer.overlap", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only", "--checkpoint.async_mode", "async_with_pinned_mem",
    ]  # fmt: skip
    train(MUON, tiny(workdir, "async_fp8_overlap", *flags, steps=4))
    straight = workdir / "async_fp8_overlap"
    assert all(v > 0 for v in read_scalars(str(straight), "muon/rounds_sent_in_backward").values())
    saved = read_checkpoint(str(straight / "checkpoint" / "step-2"))
    assert any(k.endswith("momentum_fp8") for k in saved) and not any(k.endswith("momentum_buffer") for k in saved)
    shutil.copytree(straight / "checkpoint" / "step-2", workdir / "async_fp8_overlap_resumed" / "checkpoint" / "step-2")
    train(MUON, tiny(workdir, "async_fp8_overlap_resumed", *flags, steps=4))
    expected, resumed = read_losses(str(straight)), read_losses(str(workdir / "async_fp8_overlap_resumed"))
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: expected[step] for step in resumed}


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
    assert re.search(r"qk_clip/max_logit/layers\.1\.attention: [0-9]", log)  # the TOML's MuonClip, on MLA


# ------------------------------------ mla_muon.toml: split = "fine", overlap, fp8 momentum, MuonClip, skip

MLA = "train_configs/mla_muon.toml"  # overlap = true, momentum_dtype = "fp8", qk_clip = true
NONFINITE_STEP = 2
FAULT_TRAIN = ("tests/fixtures/fault_train030.py",)  # titan_muon.train with a NaN gradient injected


@pytest.fixture(scope="module")
def mla_run(workdir) -> tuple[Path, str]:
    """mla_muon.toml on tiny_dense MLA, 3 steps on 2 ranks, with what the TOML leaves off turned on: split =
    "fine", tau 0.05 (every step clips; max logits start near 0.08) and nonfinite_grads = "skip", with rank 1's
    gradients made NaN in the backward of step 2 (the loss stays finite: torchtitan 0.3.0 stops on a
    non-finite loss). A checkpoint after every step."""
    flags = tiny(
        workdir, "mla", "--optimizer.split", "fine", "--optimizer.qk_clip_tau", "0.05",
        "--optimizer.nonfinite_grads", "skip", "--checkpoint.enable", "--checkpoint.interval", "1",
        "--checkpoint.no-last-save-model-only", steps=3, flavor="tiny_dense",
    )  # fmt: skip
    fault = {"FAULT_NONFINITE_GRAD_AT_STEP": str(NONFINITE_STEP), "FAULT_RANK": "1"}
    result = finish(start(torchrun_command(MLA, flags, entry=FAULT_TRAIN), env=fault), RUN_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"training failed (exit {result.returncode}):\n{log_tail(result)}")
    return workdir / "mla", result.stdout + result.stderr


def test_fine_split_orthogonalizes_mla_nope_and_rope_apart(mla_run):
    """tiny_dense: 4 heads, q_nope 16 | q_rope 8 rows per query head, k_nope 16 | v 16 per kv head."""
    dump, log = mla_run
    assert ('titan_muon split = \'fine\': layers.*.attention.wq_b.weight 96 rows = 4 x (16 | 8); '
            'layers.*.attention.wkv_b.weight 128 rows = 4 x (16 | 16)') in log  # fmt: skip
    assert sorted(read_losses(str(dump))) == [1, 2, 3]


def test_overlap_sends_every_round_during_backward(mla_run):
    dump, _ = mla_run
    rounds = read_scalars(str(dump), "muon/rounds")
    in_backward = read_scalars(str(dump), "muon/rounds_sent_in_backward")
    sent_in_backward = read_scalars(str(dump), "muon/bytes_sent_in_backward")
    assert sorted(in_backward) == [1, 3]  # step 2 was skipped: no update, no round used
    assert all(in_backward[step] == rounds[step] > 0 and sent_in_backward[step] > 0 for step in in_backward)
    # The bytes of a step: gradients out during backward, updates back in step(); the same every step. The
    # skipped step reports what it sent during backward (and waited for, and dropped); a checkpoint's conversion
    # of the owners' momentum to the parameters' layout is counted in no step.
    bytes_sent = read_scalars(str(dump), "muon/bytes_sent")
    assert bytes_sent == {1: bytes_sent[1], NONFINITE_STEP: sent_in_backward[1], 3: bytes_sent[1]}


def saved_tensors(checkpoint: Path, workdir: Path) -> dict[str, torch.Tensor]:
    """The model's weights and the optimizer's state (``optimizer.state.{fqn}.{name}``) of a DCP checkpoint."""
    converted = workdir / f"{checkpoint.parent.parent.name}_{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, converted)
    saved = torch.load(converted, weights_only=False)
    state = {f"optimizer.{key}": value for key, value in saved["optimizer"].items() if key.startswith("state.")}
    return {key: value for key, value in saved.items() if isinstance(value, torch.Tensor)} | state


def test_fp8_momentum_is_one_byte_per_element(mla_run, workdir):
    dump, _ = mla_run
    per_element = read_scalars(str(dump), "muon/momentum_bytes_per_element")
    # one e4m3 code byte per element plus one exponent byte per row and 256-column block: 1 + 1/cols for
    # this model's matrices (32 to 128 columns); bf16 would be 2 and fp32 4
    assert sorted(per_element) == [1, 3] and all(1.0 < v <= 1 + 1 / 32 for v in per_element.values()), per_element
    saved = saved_tensors(dump / "checkpoint" / "step-3", workdir)
    matrices = {k for k, v in saved.items() if v.ndim == 2 and k.startswith("layers.")}  # tiny_dense: all in Muon
    assert {k.removeprefix("optimizer.state.") for k in saved if k.endswith(".momentum_fp8")} == {
        f"{k}.momentum_fp8" for k in matrices
    }
    assert not any(k.endswith("momentum_buffer") for k in saved)
    for name in matrices:
        codes, exponents = saved[f"optimizer.state.{name}.momentum_fp8"], saved[f"optimizer.state.{name}.momentum_exp"]
        rows, cols = saved[name].shape
        assert codes.dtype == torch.uint8 and codes.shape == (rows, cols), name
        assert exponents.dtype == torch.int8 and exponents.shape == (rows, math.ceil(cols / 256)), name


def test_muonclip_clips_every_step_it_is_not_skipped(mla_run):
    dump, _ = mla_run
    clipped = read_scalars(str(dump), "qk_clip/heads_clipped")
    assert clipped[1] > 0 and clipped[3] > 0, clipped
    assert clipped[NONFINITE_STEP] == 0, clipped  # recorded (qk_clip/max_logit) but a skipped step moves nothing
    assert all(value > 0.05 for value in read_scalars(str(dump), "qk_clip/max_logit").values())


def test_a_nonfinite_gradient_skips_the_step_on_every_rank(mla_run, workdir):
    """Rank 1's NaN gradients in step 2: torchtitan's grad norm is NaN (and its clipping spreads the NaN to every
    gradient), Muon skips on both ranks, and step 2 changes no weight and no optimizer state, MuonClip's
    rescaling and the fp8 momentum included; training goes on at step 3."""
    dump, _ = mla_run
    assert read_scalars(str(dump), "muon/skipped_steps") == {1: 0, 2: 1, 3: 1}
    grad_norm = read_scalars(str(dump), "grad_norm")
    assert math.isnan(grad_norm[NONFINITE_STEP]) and math.isfinite(grad_norm[1]) and math.isfinite(grad_norm[3])
    assert all(math.isfinite(loss) for loss in read_losses(str(dump)).values())
    before = saved_tensors(dump / "checkpoint" / f"step-{NONFINITE_STEP - 1}", workdir)
    after = saved_tensors(dump / "checkpoint" / f"step-{NONFINITE_STEP}", workdir)
    assert before.keys() == after.keys()
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert changed == [], changed
    trained = saved_tensors(dump / "checkpoint" / "step-3", workdir)
    weight = "layers.0.feed_forward.w1.weight"
    assert not torch.equal(trained[weight], after[weight])  # and step 3 was an update again



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


# ------------------------------------------- pipeline parallel and checkpoints, one process


def test_an_unwired_pipeline_stage_refuses_to_step():
    """0.3.0 builds the optimizer without the parallel dims; a stage's Muon that never got its pipeline
    group (a trainer other than titan_muon's) must not step alone, nor MuonClip reduce over the world."""
    model = attention_model("llama3", "sdpa")
    assert not is_pipeline_stage(model)
    model.norm = model.lm_head = None  # what torchtitan's pipeline split leaves of a first stage
    assert is_pipeline_stage(model)
    optimizers = MuonOptimizersContainer(MuonOptimizersContainer.Config(qk_clip=True), model_parts=[model])
    assert optimizers.qk_clips == []  # built over the stage's groups once the parallel dims are known
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with pytest.raises(RuntimeError, match="under pipeline parallel needs the pipeline's process groups"):
        optimizers.step()


def test_demo_outside_titan_muons_trainer_is_refused_by_name():
    """DeMo needs the model sharded over each replica's fsdp mesh only and the replicate group at the
    optimizer's construction, which titan_muon's trainer arranges; a container built without it (a stock
    Trainer, or by hand) must refuse rather than run Muon without replicas."""
    model = attention_model("llama3", "sdpa")
    with pytest.raises(RuntimeError, match="demo = true under torchtitan 0.3.0 needs titan_muon's trainer"):
        MuonOptimizersContainer(MuonOptimizersContainer.Config(demo=True), model_parts=[model])


class WholeBatchSchedule:
    """torch 2.13's schedule interface: the whole batch, split into microbatches by the schedule."""

    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs):
        self.called = dict(args=args, target=target, losses=losses, loss_kwargs=loss_kwargs, kwargs=kwargs)


def test_torch_2_13_schedules_take_0_3_0s_microbatch_lists():
    schedule = WholeBatchSchedule()
    cpu.accept_microbatch_lists(schedule)
    tokens = torch.arange(8).view(4, 2)
    labels, positions = tokens + 1, tokens % 3
    losses, count = [], torch.tensor(8)
    schedule.step(
        arg_mbs=[(tokens[:2],), (tokens[2:],)], kwarg_mbs=[{"positions": positions[:2]}, {"positions": positions[2:]}],
        target_mbs=[labels[:2], labels[2:]], losses=losses, loss_kwargs={"global_valid_tokens": count},
    )  # fmt: skip
    called = schedule.called
    assert torch.equal(called["args"][0], tokens) and torch.equal(called["target"], labels)
    assert called["kwargs"].keys() == {"positions"} and torch.equal(called["kwargs"]["positions"], positions)
    assert called["losses"] is losses and called["loss_kwargs"] == {"global_valid_tokens": count}
    schedule.step(arg_mbs=None, kwarg_mbs=[{}, {}], target_mbs=None, losses=None)  # a middle stage
    assert schedule.called["args"] == () and schedule.called["target"] is None
    schedule.step(target=None, arg_mbs=[(tokens[:2],), (tokens[2:],)], target_mbs=[labels[:2], labels[2:]])  # eval()
    assert torch.equal(schedule.called["args"][0], tokens) and torch.equal(schedule.called["target"], labels)


def test_a_folder_without_a_complete_checkpoint_falls_back_to_initial_load_path_checked(tmp_path):
    """0.3.0, unlike 0.2.2, loads initial_load_path when the dump folder holds only interrupted saves: the
    pre-resume checks then look at that path (here: a truncated shard) instead of refusing the run."""
    initial = tmp_path / "initial" / "step-10"
    dcp.save({"layer.weight": torch.ones(4, 3)}, checkpoint_id=str(initial), no_dist=True)
    shard = next(initial.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    folder = tmp_path / "dump" / "checkpoint"
    (folder / "step-3").mkdir(parents=True)  # a first save that was killed
    config = CheckpointManager.Config(enable=True, initial_load_path=str(initial))
    checkpointer = SimpleNamespace(folder=str(folder), states={"model": SimpleNamespace(state_dict=dict)})
    with pytest.raises(CheckpointError, match=f"{initial}: shard {shard.name} is truncated"):
        check_before_resume(checkpointer, config, initial_load_when_none_complete=True)
    with pytest.raises(CheckpointError, match="would ignore checkpoint.initial_load_path"):  # 0.2.2
        check_before_resume(checkpointer, config)


# ---------------------------------- parallel layouts: PP, TP, HSDP, resharding (4 gloo ranks each)

LAYOUT_STEPS, LAYOUT_CHECKPOINT = 4, 2
PIPELINE = ["--parallelism.pipeline_parallel_degree", "2"]  # x FSDP 2 on 4 ranks (dp_shard = -1)
# validation at steps 2 and 4: under PP through the schedule's eval(), with the same microbatch lists
VALIDATION = [
    "--validator.enable", "--validator.freq", "2", "--validator.steps", "1",
    "--validator.dataloader.dataset", "python_stdlib_validation",
]  # fmt: skip


@pytest.fixture(scope="module")
def layouts(workdir) -> dict[str, list[str]]:
    """Flags shared by the layout runs. Every rank trains on the same sequence (one_sequence_corpus), so runs
    on different data-parallel degrees see the same mean gradient; every run starts from one seed checkpoint
    (pipeline stages and shardings would otherwise each initialize their own weights); tau 0.05 clips heads
    at every step."""
    train(MUON, tiny(workdir, "seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"), nproc=1)
    corpus = one_sequence_corpus(workdir, workdir / "tokenizer")
    seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(workdir / "seed" / "checkpoint" / "step-0")]
    common = [*seed, "--training.dataset", "text_files", "--training.dataset_path", str(corpus), *CLIPPING]
    saving = ["--checkpoint.interval", str(LAYOUT_CHECKPOINT), "--checkpoint.no-last-save-model-only"]
    return {"common": common, "no_saving": ["--checkpoint.load_only"], "saving": saving}


def layout_run(workdir, layouts, dump: str, *extra: str, nproc: int = 4, saving: bool = False) -> Path:
    flags = [*layouts["common"], *layouts["saving" if saving else "no_saving"], *extra]
    train(MUON, tiny(workdir, dump, *flags, steps=LAYOUT_STEPS), nproc=nproc)
    return workdir / dump


@pytest.fixture(scope="module")
def fsdp_run(workdir, layouts) -> Path:
    """The reference: FSDP 2 on 2 ranks."""
    return layout_run(workdir, layouts, "fsdp2", *VALIDATION, nproc=2)


@pytest.fixture(scope="module")
def pipeline_run(workdir, layouts) -> tuple[Path, str]:
    """PP 2 x FSDP 2 on 4 ranks (1F1B, 2 microbatches of one sequence), checkpoint at step 2."""
    flags = [*layouts["common"], *layouts["saving"], *PIPELINE, *VALIDATION]
    log = train(MUON, tiny(workdir, "pp2_fsdp2", *flags, steps=LAYOUT_STEPS), nproc=4)
    return workdir / "pp2_fsdp2", log


def assert_same_run(actual: Path, expected: Path, rel: float, steps=range(1, LAYOUT_STEPS + 1)) -> None:
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        got, want = read_scalars(str(actual), tag), read_scalars(str(expected), tag)
        assert sorted(got) == list(steps), tag
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=rel, abs=0), (tag, step, value, want[step])


# The layouts differ from FSDP 2 only in how fp32 sums associate. PP sums each microbatch's loss and
# gradient (one 64-token sequence) and then the microbatches, where FSDP sums a rank's 128 tokens at once:
# reassociating a sum of n = 128 terms changes it by at most about n·u = 7.6e-6 relative (u = 2^-24), which
# the step-1 loss and grad norm inherit; later steps add what weights moved by lr × a difference of that size
# change, far less. HSDP sums 4 equal per-rank gradients instead of 2 (a few ulps). Measured: 1e-7 or less.
# Were a stage's gradients not divided by the token count, the grad norm would be 128x.
REASSOCIATED = 1e-5
# TP also splits row-wise layers' dot products in two and, with loss parallel, the softmax denominator over
# the 2048-token vocabulary: n·u = 2048 · 2^-24 = 1.2e-4 relative at most (measured 5e-6, grad norm).
TENSOR_PARALLEL = 2048 * 2**-24


def test_pipeline_parallel_trains_like_fsdp(pipeline_run, fsdp_run):
    dump, log = pipeline_run
    assert_same_run(dump, fsdp_run, REASSOCIATED)
    validation = read_scalars(str(fsdp_run), "validation_metrics/loss")
    assert {2, 4} <= set(validation)
    assert read_scalars(str(dump), "validation_metrics/loss") == pytest.approx(validation, rel=REASSOCIATED, abs=0)
    assert "stages agree on non-finite gradients with ranks [0, 2], MuonClip reduces max logits within the stage" in log
    # The logging rank (the last stage's) reports its stage's layer, as recorded without PP. Reduced over the
    # world, each stage's one recorded layer would take the other's max (layer 0's 0.11 for layer 1's 0.098 at
    # step 1), a change the losses barely see (4e-6 by step 4).
    tag = "qk_clip/max_logit/layers.1.attention"
    expected = read_scalars(str(fsdp_run), tag)
    assert read_scalars(str(dump), tag) == pytest.approx(expected, rel=REASSOCIATED, abs=0)
    assert all(count > 0 for count in read_scalars(str(dump), "qk_clip/heads_clipped").values())
    # each stage's Muon exchanges its own matrices over its FSDP pair: half of the model's
    bytes_pp, bytes_fsdp = read_scalars(str(dump), "muon/bytes_sent"), read_scalars(str(fsdp_run), "muon/bytes_sent")
    assert all(0 < bytes_pp[step] < bytes_fsdp[step] for step in bytes_pp)


def copy_layout_checkpoint(source: Path, workdir: Path, dump: str) -> Path:
    target = workdir / dump / "checkpoint" / f"step-{LAYOUT_CHECKPOINT}"
    shutil.copytree(source / "checkpoint" / f"step-{LAYOUT_CHECKPOINT}", target)
    return target


def assert_resume_continues_exactly(straight: Path, workdir, layouts, dump: str, flags: list[str], tag: str) -> None:
    """A run resumed from ``straight``'s step-LAYOUT_CHECKPOINT checkpoint logs its later steps' loss,
    gradient norm and ``tag`` bit for bit."""
    copy_layout_checkpoint(straight, workdir, dump)
    resumed = layout_run(workdir, layouts, dump, *flags, saving=True)
    later = range(LAYOUT_CHECKPOINT + 1, LAYOUT_STEPS + 1)
    for name in ("loss_metrics/global_avg_loss", "grad_norm", tag):
        expected = read_scalars(str(straight), name)
        assert read_scalars(str(resumed), name) == {step: expected[step] for step in later}, name


def test_pipeline_parallel_resumes_exactly(pipeline_run, workdir, layouts):
    """Each stage loads its own parameters' state from the checkpoint of both (the pre-resume check
    compares only those) and continues bit for bit, MuonClip included."""
    dump, _ = pipeline_run
    assert_resume_continues_exactly(dump, workdir, layouts, "pp2_fsdp2_resumed", PIPELINE, "qk_clip/max_logit")


def test_pipeline_checkpoint_reshards_to_fsdp_on_2_ranks(pipeline_run, fsdp_run, workdir, layouts):
    """DCP resharding: saved by 2 stages x 2 shards on 4 ranks, loaded by FSDP 2 on 2 ranks (the
    dataloader's per-rank state does not carry over to another data-parallel degree); steps 3 and 4
    continue as the run that never changed layout."""
    dump, _ = pipeline_run
    copy_layout_checkpoint(dump, workdir, "resharded")
    resharded = layout_run(workdir, layouts, "resharded", "--checkpoint.exclude_from_loading", "dataloader", nproc=2)
    assert_same_run(resharded, fsdp_run, REASSOCIATED, steps=range(LAYOUT_CHECKPOINT + 1, LAYOUT_STEPS + 1))


def test_tensor_parallel_trains_like_fsdp(fsdp_run, workdir, layouts):
    """TP 2 x FSDP 2 on 4 ranks (torchtitan's TP plan, loss parallel, the partial_dtensor backend)."""
    dump = layout_run(workdir, layouts, "tp2_fsdp2", "--parallelism.tensor_parallel_degree", "2")
    assert_same_run(dump, fsdp_run, TENSOR_PARALLEL)
    assert all(count > 0 for count in read_scalars(str(dump), "qk_clip/heads_clipped").values())


def test_hsdp_trains_like_fsdp(fsdp_run, workdir, layouts):
    """HSDP: 2 replicas x 2 shards on 4 ranks."""
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    dump = layout_run(workdir, layouts, "hsdp", *hsdp)
    assert_same_run(dump, fsdp_run, REASSOCIATED)


DEMO = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2", "--optimizer.demo"]


@pytest.fixture(scope="module")
def demo_run(workdir, layouts) -> Path:
    """DeMo across 2 replicas x 2 shards, the shipped config and one switch, checkpoint at step 2."""
    return layout_run(workdir, layouts, "demo_2x2", *DEMO, saving=True)


def test_demo_replicas_each_get_their_own_mean_gradient(demo_run, fsdp_run):
    """Every rank sees the same sequence, so each DeMo replica's own mean gradient is FSDP 2's: step 1's
    loss and gradient norm (clipped per replica, over its fsdp mesh only) agree with it. A replica gradient
    left at torchtitan's 1/R scale would show half the norm; one still reduced across replicas as well,
    twice the norm. Later steps differ by design (DeMo's step is not Muon's)."""
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        got, want = read_scalars(str(demo_run), tag)[1], read_scalars(str(fsdp_run), tag)[1]
        assert got == pytest.approx(want, rel=REASSOCIATED, abs=0), (tag, got, want)
    losses = read_losses(str(demo_run))
    assert sorted(losses) == list(range(1, LAYOUT_STEPS + 1))
    assert losses[LAYOUT_STEPS] < losses[1]
    sent, total = read_scalars(str(demo_run), "demo/bytes_sent"), read_scalars(str(demo_run), "demo/total_bytes_sent")
    total_dense = read_scalars(str(demo_run), "demo/total_bytes_dense")
    assert sorted(sent) == sorted(total) == list(range(1, LAYOUT_STEPS + 1))
    assert all(total_dense[step] > 10 * total[step] >= 10 * sent[step] > 0 for step in sent)


def test_demo_resumes_exactly(demo_run, workdir, layouts):
    """Each replica's own momenta and error feedback are saved as its slice of a tensor over the replicas
    and loaded back as its own: the resumed run logs steps 3 and 4 bit for bit."""
    assert_resume_continues_exactly(demo_run, workdir, layouts, "demo_2x2_resumed", DEMO, "demo/total_bytes_sent")


def test_checkpoint_of_another_optimizer_setup_is_refused_before_loading(pipeline_run, workdir, layouts):
    """The 0.2.2 trainer's pre-resume checks on 0.3.0: a checkpoint whose optimizer state does not fit this
    run (here layer 0's attention moved from Muon to AdamW) is refused with the parameters that differ."""
    dump, _ = pipeline_run
    target = copy_layout_checkpoint(dump, workdir, "moved")
    moved = ["--optimizer.adamw_patterns", "layers.0.attention.*"]
    result = launch(MUON, tiny(workdir, "moved", *layouts["common"], *moved, steps=LAYOUT_STEPS))
    log = log_tail(result, 20000)
    assert result.returncode != 0
    assert f"checkpoint {target} was written with a different optimizer setup than this run" in log
    assert ("layers.0.attention.qkv_linear.wqkv.weight: checkpoint has ['momentum_buffer'], this run expects "
            "['exp_avg', 'exp_avg_sq', 'step']") in log  # fmt: skip
    assert "Training starts at step" not in log
