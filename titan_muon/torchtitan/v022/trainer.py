"""torchtitan 0.2.x's trainer with titan_muon's adapter, on GPUs or on CPUs; the launcher
``titan_muon.torchtitan.train`` runs it when torchtitan 0.2 is installed.

With CUDA this is torchtitan's trainer unchanged (NCCL). Without it, the trainer runs on
CPU processes over gloo (see titan_muon/torchtitan/cpu.py). Either way the checkpoint to
resume from is checked before it is loaded, a failed checkpoint write stops every rank
with one error naming the folder (titan_muon/torchtitan/checkpoint.py), and under pipeline
parallel the gradients are divided by the token count as without it
(titan_muon/torchtitan/v022/pipeline.py).
"""

import os
from collections.abc import Mapping

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.config import JobConfig
from torchtitan.train import Trainer as TorchTitanTrainer
from torchtitan.train import main

from titan_muon.torchtitan import cpu
from titan_muon.torchtitan.checkpoint import check_before_resume, checkpoint_io_error
from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.qk_clip import record_only_stage_forwards, use_context_parallel_load_balancer
from titan_muon.torchtitan.replicas import demo_enabled, replica_tokens
from titan_muon.torchtitan.teardown import exit_now
from titan_muon.torchtitan.v022.pipeline import check_pipeline_loss, set_global_valid_tokens


def check_restarts_can_rendezvous(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse ``torchrun --max-restarts N`` when its restarted workers could not form a group.

    torch 2.13's torchrun keeps one TCPStore for all restarts of a job ("shared store", the
    default). The process group keys of the workers it killed stay in it, so a restarted
    worker can read a dead worker's address and fail to connect (gloo: "connectFullMesh
    failed ... Connection refused"). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every
    rendezvous round gets a fresh store. See docs/reliability.md.
    """
    shared_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared_store and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise RuntimeError(
            "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment: "
            "with the store torchrun shares across restarts (torch 2.13), restarted workers read the "
            "addresses of the workers that died and cannot form a process group. Run e.g. "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 3 ... (see docs/reliability.md)"
        )


class Trainer(TorchTitanTrainer):
    def __init__(self, job_config: JobConfig):
        check_restarts_can_rendezvous()
        validate_optimizer_config(job_config.optimizer)  # before minutes of setup, not after
        super().__init__(job_config)
        check_pipeline_loss(self.loss_fn, self.parallel_dims.pp_enabled, job_config.model.name)
        qk_clips = getattr(self.optimizers, "qk_clips", [])
        if self.parallel_dims.pp_enabled:
            record_only_stage_forwards(self.pp_schedule, qk_clips)
        # before the first forward: the clips were built knowing only the optimizer config
        use_context_parallel_load_balancer(qk_clips, job_config.parallelism.context_parallel_load_balancer)
        if cpu.should_use_cpu():
            cpu.force_sum_reductions(self.model_parts)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        # With DeMo every replica's gradient is its own: divided by the tokens / R (replicas.py).
        tokens, loss_factor = replica_tokens(global_valid_tokens, demo_enabled(self.job_config), self.parallel_dims)
        set_global_valid_tokens(self.loss_fn, tokens)  # for the pipeline schedule's backward
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=tokens)
        placeholder = self.parallel_dims.pp_enabled and not self.pp_has_last_stage  # -1 on other stages
        return loss if loss_factor == 1.0 or placeholder else loss * loss_factor

    def train(self):
        check_before_resume(self.checkpointer, self.job_config.checkpoint, pipeline_stage=self.parallel_dims.pp_enabled)
        try:
            super().train()
        except CheckpointException as error:  # a BaseException: torchtitan's main would not close
            raise checkpoint_io_error(error, self.checkpointer.folder) from error


class LauncherTrainer(Trainer):
    """The trainer ``run`` starts: once a successful run has closed, the process ends at once
    instead of tearing down (titan_muon/torchtitan/teardown.py). A run that raised tears down as
    usual, so its error reaches torchrun."""

    succeeded = False

    def train(self):
        super().train()
        self.succeeded = True

    def close(self) -> None:
        super().close()
        if self.succeeded:
            exit_now()


def run() -> None:
    """Train with the command line's arguments (torchtitan's ``main``), on CPU/gloo without CUDA."""
    if cpu.should_use_cpu():
        cpu.use_cpu_device()
    main(LauncherTrainer)
