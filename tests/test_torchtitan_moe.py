"""train_configs/moe_mla_muon.toml under torchrun on CPU/gloo: DeepSeek-V3 MoE + MLA with Muon
(routed experts are Muon parameters), Split, MuonClip (forced to clip), fp8 momentum, overlap.

Every rank reads the same one-sequence batch, so runs on any number of ranks and with or
without expert parallel compute the same losses. One 2-rank reference run (4 steps,
checkpoint at step 2) serves every test; each launch has a timeout.
"""

from pathlib import Path

import pytest
import torch
from distributed import tiny_run_flags
from test_torchtitan_train import RUN_TIMEOUT, copy_checkpoint, one_sequence_corpus
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_muon.torchtitan.data import OFFLINE_DATASETS, STDLIB_DIR, ensure_offline_tokenizer
from titan_muon.torchtitan.harness import read_losses, read_scalars, run_training

pytestmark = pytest.mark.timeout(1800)

CONFIG = "train_configs/moe_mla_muon.toml"
STEPS, RESUME_STEP = 4, 2
EXPERT_PARALLEL = ["--parallelism.expert_parallel_degree", "2"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchtitan_moe")


@pytest.fixture(scope="module")
def data(workdir) -> list[str]:
    tokenizer = workdir / "tokenizer"
    ensure_offline_tokenizer(str(tokenizer), STDLIB_DIR, OFFLINE_DATASETS["python_stdlib"], vocab_size=2048)
    corpus = one_sequence_corpus(workdir, tokenizer)
    return ["--training.dataset", "text_files", "--training.dataset_path", str(corpus)]


def tiny_moe(workdir: Path, dump: str, data: list[str], *extra: str) -> list[str]:
    return [*tiny_run_flags(workdir, dump, STEPS, "tiny_moe"), "--optimizer.qk_clip_tau", "0.05", *data, *extra]


def train(workdir, dump, data, *extra, nproc=2) -> dict[int, float]:
    run_training(CONFIG, tiny_moe(workdir, dump, data, *extra), nproc=nproc, timeout=RUN_TIMEOUT)
    return read_losses(str(workdir / dump))


CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", str(RESUME_STEP), "--checkpoint.no-last-save-model-only"]


@pytest.fixture(scope="module")
def reference(workdir, data) -> Path:
    """2 ranks, FSDP, 4 steps; checkpoints at steps 2 and 4."""
    train(workdir, "reference", data, *CHECKPOINTS)
    return workdir / "reference"


def load_checkpoint(checkpoint: Path, workdir: Path) -> dict:
    converted = workdir / f"{checkpoint.parent.parent.name}_{checkpoint.name}.pt"
    if not converted.exists():
        dcp_to_torch_save(str(checkpoint), str(converted))
    return torch.load(converted, weights_only=False)


def test_moe_trains_with_muon_split_muonclip_fp8_and_load_balancing(reference, workdir):
    losses = read_losses(str(reference))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    assert any(v > 0 for v in read_scalars(str(reference), "qk_clip/heads_clipped").values())  # MuonClip clipped
    assert any(v > 0 for v in read_scalars(str(reference), "muon/rounds_sent_in_backward").values())  # overlap ran
    saved = load_checkpoint(reference / "checkpoint" / f"step-{RESUME_STEP}", workdir)
    optimizer = saved["optimizer"]
    # Routed experts are Muon parameters with fp8 momentum, one row scale per expert row; the router is AdamW.
    assert optimizer["state.layers.1.moe.experts.w1.momentum_fp8"].shape == (6, 32, 64)
    assert optimizer["state.layers.1.moe.experts.w2.momentum_exp"].shape == (6, 64, 1)
    router_state = {key.rsplit(".", 1)[1] for key in optimizer if key.startswith("state.layers.1.moe.router.")}
    assert {"exp_avg", "exp_avg_sq"} <= router_state
    # torchtitan's expert-bias hook ran before each step on our optimizer: each step adds
    # ±load_balance_coeff (1e-3) per expert, less the mean, so after two steps biases are
    # multiples of 1e-3 / 3 (6 experts) and not all zero.
    bias_at_2 = saved["layers.1.moe.expert_bias"]
    bias_at_4 = load_checkpoint(reference / "checkpoint" / f"step-{STEPS}", workdir)["layers.1.moe.expert_bias"]
    assert bias_at_2.abs().max() > 0
    assert not torch.equal(bias_at_2, bias_at_4)


def test_resume_continues_exactly_like_the_straight_run(reference, workdir, data):
    copy_checkpoint(reference, workdir, "resumed", RESUME_STEP)
    resumed = train(workdir, "resumed", data, *CHECKPOINTS)
    straight = read_losses(str(reference))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}  # bit for bit


def test_expert_parallel_equals_fsdp(reference, workdir, data):
    """EP = 2 on 2 ranks: each rank holds 3 of the 6 experts and tokens travel all-to-all."""
    expert_parallel = train(workdir, "expert_parallel", data, *EXPERT_PARALLEL)
    straight = read_losses(str(reference))
    assert sorted(expert_parallel) == list(range(1, STEPS + 1))
    for step, loss in expert_parallel.items():  # experts sum their tokens' gradients in another order
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-5), step


@pytest.mark.parametrize(
    "nproc, parallelism",
    [(1, []), (4, EXPERT_PARALLEL)],
    ids=["1-rank", "4-ranks-ep2"],  # EP 2 x FSDP 2: experts _StridedShard(0) x Shard(0)
)
def test_reshard_from_2_ranks(reference, workdir, data, nproc, parallelism):
    dump = f"reshard_{nproc}"
    copy_checkpoint(reference, workdir, dump, RESUME_STEP)
    overrides = ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader", *parallelism]
    resumed = train(workdir, dump, data, *overrides, nproc=nproc)
    expected = read_losses(str(reference))
    assert sorted(resumed) == list(range(RESUME_STEP + 1, STEPS + 1))
    for step, loss in resumed.items():  # only the order of gradient sums differs
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-5), step
