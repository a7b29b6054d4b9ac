"""torchtitan 0.3.0's Trainer, made to run on torch 2.13 and on CPU (gloo).

``MuonTrainer.Config`` is torchtitan's ``Trainer.Config`` unchanged; being a subclass, it builds
:class:`MuonTrainer`, which applies titan_muon.torchtitan.v030.cpu before torchtitan's setup (and
FSDP's SUM reductions on CPU after it), and refuses what titan_muon's Muon does not support
under 0.3.0 yet, before minutes of setup rather than after. Every config function of
titan_muon.torchtitan.v030.config_registry and the TOML launcher return this Config, so
torchtitan's own ``python -m torchtitan.train --module titan_muon.torchtitan.v030 --config ...``
runs it too. As the 0.2.2 trainer (titan_muon.torchtitan.v022.trainer) does, it also:

* hands the optimizer the parallel dims that 0.3.0 builds it without: under pipeline parallel
  each stage's Muon joins the pipeline group (non-finite gradients raise or skip in every
  stage), MuonClip reduces max logits over its stage and records only the schedule's real
  forwards. The pipeline loss needs no fix, unlike 0.2.2's (titan_muon.torchtitan.v022.pipeline):
  0.3.0 hands the step's token count to the loss inside the schedule;
* under context parallel (SDPA), builds MuonClip's recorder with the ``cp`` mesh's sequence layout
  and the run's ``context_parallel_load_balancer``, as the 0.2.2 trainer does (FlexAttention under
  context parallel is refused: :func:`~titan_muon.torchtitan.qk_clip.refuse_context_parallel_030`);
* with ``[optimizer] demo = true``, lets the optimizer own the replicate dimension as the 0.2.2
  adapter does (titan_muon.torchtitan.replicas): FSDP2 over each replica's ``fsdp`` mesh only, each
  replica's loss divided by its own tokens, and the parallel dims lent to the optimizer container
  while torchtitan builds it (for the ``dp_replicate`` group);
* checks the checkpoint it is about to resume from before loading it (shards whole, model and
  optimizer state fitting this run: titan_muon.torchtitan.checkpoint), and turns a failed
  checkpoint write into one error naming the folder.
"""

import dataclasses
from dataclasses import dataclass, fields

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.models.common.attention import FlexAttention
from torchtitan.trainer import Trainer

from titan_muon.torchtitan.checkpoint import check_before_resume, checkpoint_io_error
from titan_muon.torchtitan.qk_clip import (
    record_only_stage_forwards,
    refuse_context_parallel_030,
    use_context_parallel_load_balancer,
)
from titan_muon.torchtitan.replicas import (
    check_replicas,
    replica_tokens,
    without_replicas,
)
from titan_muon.torchtitan.v030 import cpu
from titan_muon.torchtitan.v030.optimizer import (
    MuonOptimizersContainer,
    building_with,
    check_config,
)


def check_supported(config: Trainer.Config) -> None:
    if not isinstance(config.optimizer, MuonOptimizersContainer.Config):
        return
    check_config(config.optimizer)
    if config.optimizer.qk_clip:
        flex = any(True for _ in config.traverse(FlexAttention.Config))
        refuse_context_parallel_030(config.parallelism.context_parallel_degree, flex)
        if not config.training.disable_cuda_graphs:
            raise ValueError(
                "optimizer.qk_clip records max attention logits with Python hooks in the forward, which a CUDA "
                "graph of forward + backward would replay from its first capture: set --training.disable_cuda_graphs"
            )
    if config.optimizer.overlap and not config.training.disable_cuda_graphs:
        raise ValueError(
            "optimizer.overlap sends gradient rows during backward, which a CUDA graph of forward + backward "
            "cannot hold: set --training.disable_cuda_graphs"
        )


def parallelize_without_replicas(parallelize_fn):
    """torchtitan 0.3.0's ``parallelize_fn`` seeing a replicate degree of 1 (titan_muon.torchtitan.replicas):
    FSDP2 over the ``fsdp`` mesh only, no gradient reduction across replicas. Pipeline parallel builds its
    stages with the model spec's ``parallelize_fn``, so it gets this one too."""

    def parallelize(model, *, parallel_dims, **kwargs):
        check_replicas(parallel_dims)
        return parallelize_fn(model, parallel_dims=without_replicas(parallel_dims), **kwargs)

    parallelize.__wrapped__ = parallelize_fn
    return parallelize


class MuonTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config):
        cpu.prepare(config)
        check_supported(config)
        self.demo = isinstance(config.optimizer, MuonOptimizersContainer.Config) and config.optimizer.demo
        if self.demo:  # FSDP2 on each replica's fsdp mesh only: the optimizer owns the replicas
            config.model_spec = dataclasses.replace(
                config.model_spec, parallelize_fn=parallelize_without_replicas(config.model_spec.parallelize_fn)
            )
        with building_with(lambda: getattr(self, "parallel_dims", None)):
            super().__init__(config)
        if cpu.should_use_cpu():
            cpu.force_sum_reductions(self.model_parts)
        if isinstance(self.optimizers, MuonOptimizersContainer):
            self.optimizers.use_parallel_dims(self.parallel_dims)  # 0.3.0 built it without them
            # before the first forward: the clips' context-parallel layout takes the run's load balancer
            use_context_parallel_load_balancer(self.optimizers.qk_clips, config.parallelism.context_parallel_load_balancer)
        if self.parallel_dims.pp_enabled:
            cpu.accept_microbatch_lists(self.pp_schedule)
            record_only_stage_forwards(self.pp_schedule, getattr(self.optimizers, "qk_clips", []))

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        # With DeMo every replica's gradient is its own: divided by the tokens / R (replicas.py).
        tokens, loss_factor = replica_tokens(global_valid_tokens, self.demo, self.parallel_dims)
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=tokens)
        placeholder = self.parallel_dims.pp_enabled and not self.pp_has_last_stage  # -1 on the other stages
        return loss if loss_factor == 1.0 or placeholder else loss * loss_factor

    def train(self):
        if isinstance(self.checkpointer, CheckpointManager):  # DCP; not the torch_checkpointing backend
            check_before_resume(
                self.checkpointer, self.config.checkpoint, pipeline_stage=self.parallel_dims.pp_enabled,
                initial_load_when_none_complete=True,
            )  # fmt: skip
        try:
            super().train()
        except CheckpointException as error:  # every rank's causes, in one readable error
            raise checkpoint_io_error(error, self.checkpointer.folder) from error


def as_muon_trainer(config: Trainer.Config) -> MuonTrainer.Config:
    """``config`` (any recipe's ``Trainer.Config``) as a ``MuonTrainer.Config``: the same fields,
    building the trainer that applies the CPU shims. A Config of another Trainer subclass is kept."""
    if type(config) is not Trainer.Config:
        return config
    return MuonTrainer.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})
