"""Pipeline parallel: the loss that normalizes PP gradients, one Muon per stage, and
torchtitan PP runs (2 stages on 2 CPU ranks, gloo) that equal the one-process run.

Every launch has a timeout (tests/distributed.py, titan_muon.torchtitan.harness).
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from common import make_params, run_titan
from distributed import run_distributed, tiny_run_flags
from pipeline_stages import (
    DP, MUON, SETTINGS, STAGE_SHAPES, STEPS, no_muon_stage_run, stage_reservation_failure_run, stage_run, stage_skip_run,
)
from torch import nn
from torchtitan.components.loss import cross_entropy_loss

from titan_muon.attention.split import attention_row_blocks
from titan_muon.torchtitan.harness import read_losses, read_scalars, run_training
from titan_muon.torchtitan.v022.pipeline import PipelineLoss, check_pipeline_loss, pipeline_loss_builder

pytestmark = pytest.mark.timeout(900)

# --------------------------------------------------------------- the loss


def _logits_and_labels(seed: int = 0, batch: int = 2, seq: int = 5, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(vocab, (batch, seq), generator=g)
    labels[0, 0] = -100  # torchtitan's ignore index: not a valid token
    return torch.randn(batch, seq, vocab, generator=g), labels


def test_pipeline_loss_divides_the_gradient_not_the_value():
    logits, labels = _logits_and_labels()
    tokens = torch.tensor(9.0)  # the step's global valid-token count, as the trainer passes it

    expected_pred = logits.clone().requires_grad_()
    (cross_entropy_loss(expected_pred, labels) / tokens).backward()  # torchtitan without PP

    pred = logits.clone().requires_grad_()
    loss = PipelineLoss(cross_entropy_loss)
    loss.global_valid_tokens = tokens
    value = loss(pred, labels)
    torch.autograd.backward([value])  # as the pipeline schedule runs it

    assert torch.equal(value.detach(), cross_entropy_loss(logits, labels))  # the sum torchtitan reports from
    assert torch.equal(pred.grad, expected_pred.grad)  # the same division, so bit for bit


def test_pipeline_loss_under_no_grad_is_the_sum_and_needs_no_count():
    logits, labels = _logits_and_labels()
    with torch.no_grad():  # torchtitan's validator
        value = PipelineLoss(cross_entropy_loss)(logits, labels)
    assert torch.equal(value, cross_entropy_loss(logits, labels))


def test_pipeline_loss_without_a_count_refuses_to_train():
    logits, labels = _logits_and_labels()
    with pytest.raises(RuntimeError, match="global valid-token count was not set"):
        PipelineLoss(cross_entropy_loss)(logits.requires_grad_(), labels)


@pytest.mark.parametrize("pp_enabled", [False, True])
def test_loss_is_wrapped_under_pipeline_parallel_only(pp_enabled):
    build = pipeline_loss_builder(lambda job_config, **kwargs: cross_entropy_loss)
    loss_fn = build(None, parallel_dims=SimpleNamespace(pp_enabled=pp_enabled))
    assert isinstance(loss_fn, PipelineLoss) is pp_enabled


def test_pipeline_parallel_with_another_train_spec_is_refused():
    check_pipeline_loss(cross_entropy_loss, pp_enabled=False, model_name="llama3")
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree > 1 with \[model\] name = 'llama3'.*#2972"):
        check_pipeline_loss(cross_entropy_loss, pp_enabled=True, model_name="llama3")


def test_split_accepts_a_stage_without_attention_under_pipeline_parallel_only():
    embeddings_only = nn.Sequential(nn.Embedding(10, 4))  # a first stage of torchtitan's interleaved schedules
    assert attention_row_blocks(embeddings_only, "head", missing_ok=True) == {}
    with pytest.raises(ValueError, match="no torchtitan llama3 / deepseek_v3 attention module"):
        attention_row_blocks(embeddings_only, "head")


# ------------------------------------------------- one optimizer per stage


@pytest.mark.parametrize("policy, join_later", [("skip", False), ("raise", False), ("skip", True)])
def test_a_nonfinite_gradient_in_one_stage_skips_or_raises_in_every_stage(policy, join_later):
    """Each stage's optimizer used to decide alone: stage 0 stepped while stage 1 skipped.
    ``join_later``: the pipeline group given by set_pipeline_group after construction (0.3.0)."""
    for result in run_distributed(stage_skip_run, 2 * DP, policy, join_later):
        assert result["unchanged"], result["stage"]
        if policy == "skip":
            assert result["outcome"] == "stepped" and result["skipped"] == 1
        else:
            where = "['c']" if result["stage"] == 1 else "another pipeline stage"
            assert "non-finite" in result["outcome"] and where in result["outcome"]


@pytest.mark.parametrize("layers, empty_stage, names", [(4, 3, ["norm", "output"]), (2, 0, ["tok_embeddings"])])
def test_torchtitans_pipeline_split_of_the_shipped_model_makes_stages_without_muon_matrices(layers, empty_stage, names):
    """The layouts below are torchtitan's own: its split into 4 parts (PP 4, or PP 2 interleaved)
    of the shipped debug model (4 layers), or of a 2-layer one, gives a part whose parameters all go
    to AdamW."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    from titan_muon import build_param_groups

    parts = generate_llm_fqn_per_model_part(4, layers)
    assert parts[empty_stage] == names, parts
    with torch.device("meta"):
        model = Transformer(TransformerModelArgs(dim=256, n_layers=layers, n_heads=8, n_kv_heads=2, vocab_size=2048))
    stage = [(n, p) for n, p in model.named_parameters() if n.split(".")[0] in names]
    groups = build_param_groups(stage)
    assert [g["use_muon"] for g in groups] == [False] and len(groups[0]["params"]) == len(stage)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("stages", [1, 2], ids=["fsdp2", "pp2xfsdp2"])
def test_a_stage_without_muon_matrices_agrees_over_all_its_ranks(stages, policy, bad):
    """A model part whose parameters are all AdamW's agreed with itself alone (its agreement group
    came from the Muon matrices): with FSDP 2 rank 0 stepped while rank 1 skipped, and under PP the
    other stage's ranks then waited for each other forever. Now every rank of every stage skips, or
    raises, and nothing changes; the agreement spans the stage's FSDP ranks."""
    for rank, result in enumerate(run_distributed(no_muon_stage_run, 2 * DP if stages == 2 else DP, policy, stages, bad, timeout=120)):
        stage = result["stage"]
        assert result["agreement_ranks"] == list(range(stage * DP, (stage + 1) * DP)), rank
        assert result["unchanged"], (rank, result["outcome"])
        if policy == "skip":
            assert result["outcome"] == "stepped" and result["skipped"] == 1, (rank, result)
        else:
            where = "['output']" if stage == stages - 1 else "another pipeline stage"
            assert "non-finite" in result["outcome"] and where in result["outcome"], (rank, result["outcome"])


@pytest.mark.parametrize("with_pipeline_group", [False, True], ids=["stages-alone", "pipeline-group"])
def test_each_stage_optimizer_exchanges_within_its_stage(with_pipeline_group):
    """With the pipeline group too, a stage streams its step, reserved (its reservation rides the
    verdict over the pipeline), and equals one process as without it."""
    results = run_distributed(stage_run, 2 * DP, with_pipeline_group)
    for rank, result in enumerate(results):
        assert result["commit_plan"] == (True, True), rank  # commit="auto", fp32 momentum on the shards
        stage = result["stage"]
        assert stage == rank // DP  # torchtitan's mesh order: pp outermost
        assert result["exchange_ranks"] == list(range(stage * DP, (stage + 1) * DP))
        expected, _ = run_titan(make_params(stage, STAGE_SHAPES[stage]), STEPS, MUON, **SETTINGS)
        # Elementwise math is identical; Newton-Schulz runs on the same assembled matrices, but
        # batched by shape with other matrices of this stage, whose matmul kernels may sum in
        # another order: a few fp32 ulps per step on O(1) weights, 1e-5 is ~80 ulps at 1.0.
        for name, tensor in result["params"].items():
            assert (tensor - expected[name]).abs().max().item() <= 1e-5, (rank, name)


@pytest.mark.parametrize("failing_rank", [1, 3], ids=["stage0", "stage1"])
def test_a_reservation_that_fails_in_one_stage_raises_in_every_stage_before_anything_is_written(failing_rank):
    """One rank of one stage cannot reserve its streaming step's memory: the stage's verdict
    all-reduce tells its own ranks, the pipeline's MAX the other stage's, so all four raise with
    parameters and momentum unchanged, before the first round is written anywhere."""
    results = run_distributed(stage_reservation_failure_run, 2 * DP, failing_rank)
    for rank, result in enumerate(results):
        assert result["commit_plan"] == (True, True), rank
        assert result["unchanged"], rank
        if result["stage"] == failing_rank // DP:
            assert "1 rank(s) could not reserve the memory of a streaming step" in result["outcome"], (rank, result["outcome"])
            assert ("injected failure" in result["outcome"]) == (rank == failing_rank), result["outcome"]
        else:
            assert "a rank of another pipeline stage could not reserve" in result["outcome"], (rank, result["outcome"])
        assert "nothing was changed" in result["outcome"]


@pytest.mark.parametrize("nan_stage", [0, 1])
def test_a_skipped_step_outranks_a_failed_reservation_across_stages(nan_stage):
    """Rank 1 (stage 0) cannot reserve while stage `nan_stage` has a NaN gradient, with
    nonfinite_grads="skip": the pipeline's MAX carries NONFINITE over UNRESERVED, so every rank of
    both stages skips the step (nothing is written either way) instead of some raising."""
    for rank, result in enumerate(run_distributed(stage_reservation_failure_run, 2 * DP, 1, nan_stage)):
        assert result["outcome"] == "stepped" and result["skipped"] == 1 and result["unchanged"], (rank, result["outcome"])


# ------------------------------------------------------- torchtitan runs

CONFIG = "train_configs/llama3_gqa_muon.toml"
TRAIN_STEPS = 4  # the step lists below assume 4
RUN_TIMEOUT = 600  # seconds; a run takes ~20 s on an idle 2-core machine, minutes on a busy one


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


def tiny(workdir: Path, dump: str, *extra: str) -> list[str]:
    # MuonClip on with a tau so small that heads are clipped every step: recording (per
    # stage, real forwards only) and clipping must match the one-process run too.
    return [*tiny_run_flags(workdir, dump, TRAIN_STEPS), "--optimizer.qk_clip", "--optimizer.qk_clip_tau", "0.05", *extra]


# Validation at steps 1 and 4: the pipeline schedule's eval() calls the same loss, without autograd.
VALIDATION = [
    "--validation.enable", "--validation.dataset", "python_stdlib_validation", "--validation.freq", "4",
    "--validation.steps", "1", "--validation.seq_len", "64", "--validation.local_batch_size", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def seed_checkpoint(workdir) -> list[str]:
    """torchtitan's seed checkpoint (one rank): PP stages would otherwise each initialize their own layers."""
    seed = tiny(workdir, "seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    run_training(CONFIG, seed, nproc=1, timeout=RUN_TIMEOUT)
    path = workdir / "seed" / "checkpoint" / "step-0"
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(path), "--checkpoint.load_only"]


@pytest.fixture(scope="module")
def one_process(workdir, seed_checkpoint) -> Path:
    """The reference: one rank, the same global batch (PP with dp = 1 has no data parallelism)."""
    # torchrun sets OMP_NUM_THREADS=1 only with several ranks; the same thread count keeps kernels alike.
    overrides = tiny(workdir, "one_process", *seed_checkpoint, *VALIDATION)
    run_training(CONFIG, overrides, nproc=1, timeout=RUN_TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    return workdir / "one_process"


@pytest.mark.parametrize(
    "schedule",
    [
        "1F1B",  # one stage per rank
        "Interleaved1F1B",  # two model parts per rank: embeddings | layer 0, layer 1 | norm + output
    ],
)
def test_pipeline_run_equals_one_process(workdir, seed_checkpoint, one_process, schedule):
    dump = f"pp_{schedule}"
    pipeline = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule]
    run_training(CONFIG, tiny(workdir, dump, *seed_checkpoint, *VALIDATION, *pipeline), nproc=2, timeout=RUN_TIMEOUT)
    # The runs differ only in how fp32 sums associate: PP adds up per-microbatch loss and
    # gradient sums (2 microbatches of 64 tokens), the one process sums the 128 tokens at
    # once. Reassociating a sum of n = 128 terms changes it by at most about n·u = 7.6e-6
    # relative (u = 2^-24), and the step-1 grad norm inherits that; later steps add the loss
    # change from weights that moved lr × (a difference of that size), far smaller.
    # Without the gradient normalization the grad norm is 128x (the tokens per step), while
    # the losses stay within 3e-6 (clipping and Muon hide the scale): compare both.
    tolerance = dict(rel=1e-5, abs=0)
    logged_steps = {"loss_metrics/global_avg_loss": [1, 2, 3, 4], "grad_norm": [1, 2, 3, 4], "validation_metrics/loss": [1, 4]}
    for tag, steps in logged_steps.items():
        expected, actual = read_scalars(str(one_process), tag), read_scalars(str(workdir / dump), tag)
        assert sorted(actual) == steps, tag
        for step, value in actual.items():
            assert value == pytest.approx(expected[step], **tolerance), (tag, step)
    # Heads were clipped every step; under PP the logging rank reports its own stage's layers.
    assert all(v > 0 for v in read_scalars(str(workdir / dump), "qk_clip/heads_clipped").values())
    # dp = 1: the parameters are plain tensors, so each stage's Muon sends nothing.
    assert set(read_scalars(str(workdir / dump), "muon/bytes_sent").values()) == {0.0}
    assert read_losses(str(workdir / dump))[TRAIN_STEPS] < read_losses(str(workdir / dump))[1]


def test_tensor_parallel_run_equals_one_process(workdir, seed_checkpoint, one_process):
    """torchtitan's own TP plan (2 ranks, dp = 1): each Muon matrix is assembled whole on its
    owner from the two TP halves; MuonClip scales the head rows each rank holds."""
    dump = "tp"
    tensor_parallel = ["--parallelism.tensor_parallel_degree", "2"]
    run_training(CONFIG, tiny(workdir, dump, *seed_checkpoint, *VALIDATION, *tensor_parallel), nproc=2, timeout=RUN_TIMEOUT)
    # TP reassociates fp32 sums: row-wise layers add two partial products, and with loss
    # parallel (torchtitan's default under TP) softmax's denominator over the 2048-token
    # vocabulary is summed per half: n·u = 2048 · 2^-24 = 1.2e-4 relative at most, in the
    # step-1 grad norm too (measured 1.2e-5: the weights are identical at step 1, so this is
    # torchtitan's TP numerics, before any optimizer step).
    tolerance = dict(rel=2048 * 2**-24, abs=0)
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        expected, actual = read_scalars(str(one_process), tag), read_scalars(str(workdir / dump), tag)
        assert sorted(actual) == [1, 2, 3, 4], tag
        for step, value in actual.items():
            assert value == pytest.approx(expected[step], **tolerance), (tag, step)
    assert all(v > 0 for v in read_scalars(str(workdir / dump), "qk_clip/heads_clipped").values())
    assert all(v > 0 for v in read_scalars(str(workdir / dump), "muon/bytes_sent").values())  # TP halves travel
