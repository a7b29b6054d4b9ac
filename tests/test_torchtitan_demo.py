"""[optimizer] demo = true under torchrun on CPU/gloo: DeMo across data_parallel_replicate replicas.

Tiny Llama runs of a few steps on a corpus whose every sequence is the same, so that every rank
sees the same batch whatever the layout: step 1's gradient norm of R = 2 replicas × S = 2
shards (FSDP2 on the shard mesh only) must then be HSDP's (each replica's gradient is its own
mean, replicas.py). R = 2 × S = 1 runs without FSDP. Every DeMo run is the shipped config with
``--optimizer.demo`` (and a k): what DeMo needs follows from that one switch.
"""

import shutil
from pathlib import Path

import pytest
from distributed import tiny_run_flags, trainer_flags
from test_torchtitan_train import assert_same_checkpoint, one_sequence_corpus

from titan_muon.torchtitan.harness import read_losses, read_scalars, run_training

pytestmark = pytest.mark.timeout(1800)

MUON = "train_configs/llama3_gqa_muon.toml"
STEPS = 4
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only"]
# One switch on the shipped Muon config (momentum 0.95, nesterov = true: the shared momentum's,
# demo_alpha 1 by default); k = 16 only so that the byte check below has a clear margin.
DEMO = ["--optimizer.demo", "--optimizer.demo_topk", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("torchtitan_demo")

    def run(dump: str, nproc: int, *extra: str) -> Path:
        flags = [*tiny_run_flags(workdir, dump, STEPS), *trainer_flags(), *extra]
        run_training(MUON, flags, nproc=nproc, timeout=900)
        return workdir / dump

    # The first run (the stdlib corpus) builds the offline tokenizer under workdir, which the corpus needs.
    stdlib = run("demo_stdlib", 4, "--parallelism.data_parallel_replicate_degree", "2", *DEMO, *CHECKPOINT)
    corpus = one_sequence_corpus(workdir, workdir / "tokenizer")
    data = ["--training.dataset", "text_files", "--training.dataset_path", str(corpus)]
    return {
        "hsdp_same_batches": run("hsdp_same", 4, "--parallelism.data_parallel_replicate_degree", "2", "--optimizer.no-nesterov", *data),
        "demo_2x2": run("demo_2x2", 4, "--parallelism.data_parallel_replicate_degree", "2", *DEMO, *data),
        "demo_2x1": run("demo_2x1", 2, "--parallelism.data_parallel_replicate_degree", "2", *DEMO, "--optimizer.demo_compressor", "low_rank", *data),
        "demo_stdlib": stdlib,
    }


def test_demo_runs_and_logs_its_bytes(runs):
    folder = str(runs["demo_stdlib"])
    losses = read_losses(folder)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    sent, dense = read_scalars(folder, "demo/bytes_sent"), read_scalars(folder, "demo/bytes_dense")
    assert sorted(sent) == sorted(dense) == list(range(1, STEPS + 1))
    # rank 0's matrices: at k = 16 per 64×64 chunk, a dense all-reduce of 2 replicas sends far more
    assert all(dense[s] > 20 * sent[s] > 0 for s in sent)
    # everything that crosses replicas, the AdamW tensors' sign payloads (the default) included
    adamw, total = read_scalars(folder, "demo/adamw_bytes_sent"), read_scalars(folder, "demo/total_bytes_sent")
    total_dense = read_scalars(folder, "demo/total_bytes_dense")
    assert all(total[s] == sent[s] + adamw[s] and total_dense[s] > 10 * total[s] for s in sent)


def test_each_replica_gets_its_own_mean_gradient(runs):
    """Every rank sees the same sequence, so each replica's own mean gradient is HSDP's: step 1's
    gradient norm (before any update, same initial weights) must agree. A replica gradient
    left at torchtitan's 1/R scale would show a norm half as large."""
    demo = read_scalars(str(runs["demo_2x2"]), "grad_norm")
    hsdp = read_scalars(str(runs["hsdp_same_batches"]), "grad_norm")
    assert demo[1] == pytest.approx(hsdp[1], rel=1e-5)
    assert read_losses(str(runs["demo_2x2"]))[1] == pytest.approx(read_losses(str(runs["hsdp_same_batches"]))[1], rel=1e-6)


def test_demo_without_fsdp(runs):
    """R = 2 × S = 1 with ``--optimizer.demo_compressor low_rank``: no FSDP at all (torchtitan
    would apply DDP; with demo nothing reduces the gradients but the optimizer), the matrices
    whole on every rank. It trains, and its replicas
    start identical (Muon checks that when it is built). Its losses are not compared with
    R = 2 × S = 2: torchtitan initializes plain tensors and DTensors from different random
    streams (tests/test_demo_distributed.py compares the layouts from the same weights)."""
    losses = read_losses(str(runs["demo_2x1"]))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    sent = read_scalars(str(runs["demo_2x1"]), "demo/bytes_sent")
    assert all(value > 0 for value in sent.values())


def test_demo_resume_continues_exactly(runs, tmp_path):
    """A DeMo run resumed from its step-2 checkpoint (each replica's momentum saved as its own
    slice) logs the straight run's losses at steps 3 and 4 bit for bit; resuming it on 4
    replicas of 1 rank instead of 2 × 2 is refused before loading, naming the replica counts."""
    straight = runs["demo_stdlib"]
    workdir = straight.parent

    def resume(dump: str, *extra: str):
        shutil.copytree(straight / "checkpoint" / "step-2", workdir / dump / "checkpoint" / "step-2")
        flags = [*tiny_run_flags(workdir, dump, STEPS), *trainer_flags(), *DEMO, *CHECKPOINT, *extra]
        return run_training(MUON, flags, nproc=4, timeout=900, check=False)

    result = resume("demo_resumed", "--parallelism.data_parallel_replicate_degree", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    expected, resumed = read_losses(str(straight)), read_losses(str(workdir / "demo_resumed"))
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: expected[step] for step in resumed}
    result = resume("demo_four_replicas", "--parallelism.data_parallel_replicate_degree", "4")
    assert result.returncode != 0
    assert "momenta of 2 replicas, this run has 4" in result.stdout + result.stderr


def test_demo_async_checkpoint_equals_the_synchronous_one_and_resumes_exactly(runs):
    """[checkpoint] async_mode = "async" with DeMo (each replica's momentum saved as its own slice of
    a (replicas, ...) tensor, built in state_dict() on the training thread): the run logs the
    synchronous run's losses, its step-2 checkpoint equals that run's entry by entry, and a run
    resumed from it logs steps 3 and 4 bit for bit."""
    straight = runs["demo_stdlib"]
    workdir = straight.parent
    replicas = ["--parallelism.data_parallel_replicate_degree", "2", *DEMO, *CHECKPOINT, "--checkpoint.async_mode", "async"]

    def run(dump: str) -> Path:
        run_training(MUON, [*tiny_run_flags(workdir, dump, STEPS), *trainer_flags(), *replicas], nproc=4, timeout=900)
        return workdir / dump

    saved = run("demo_async")
    expected = read_losses(str(straight))
    assert read_losses(str(saved)) == expected
    assert_same_checkpoint(saved / "checkpoint" / "step-2", straight / "checkpoint" / "step-2")
    shutil.copytree(saved / "checkpoint" / "step-2", workdir / "demo_async_resumed" / "checkpoint" / "step-2")
    resumed = read_losses(str(run("demo_async_resumed")))
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: expected[step] for step in resumed}
