"""``build_optimizers_fn`` for the titan_muon train specs.

``[optimizer] name = "Muon"`` builds one :class:`titan_muon.Muon` per model part (Muon for
hidden matrices and routed MoE experts, AdamW for embeddings, the output head, the router,
norms and biases), wrapped in a subclass of torchtitan's ``OptimizersContainer`` so its
checkpointing (flattened DCP optimizer state dicts) and LR schedulers (one ``LambdaLR`` per
optimizer, scaling every param group) work unchanged. Any other name goes to torchtitan's
own builder. :func:`build_optimizers_with_moe_load_balancing` adds torchtitan's MoE
expert-bias hook to either.
"""

from contextlib import contextmanager
from typing import Any

import torch.nn as nn
import torchtitan.components.optimizer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import (
    build_optimizers as build_torchtitan_optimizers,
)
from torchtitan.distributed import ParallelDims

from titan_muon import Muon
from titan_muon.step.agreement import agreeing_model_parts
from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.metrics import measure_logged_steps_only, time_optimizer_steps
from titan_muon.torchtitan.muon import (  # noqa: F401
    build_muon,
    merged_step_metrics,
    muon_kwargs,
    param_group_kwargs,
)
from titan_muon.torchtitan.qk_clip import QKClipAfterStep
from titan_muon.torchtitan.replicas import check_replicas


class MuonOptimizersContainer(QKClipAfterStep, OptimizersContainer):
    """One :class:`titan_muon.Muon` per model part, with its own Muon / AdamW split; MuonClip
    after each step with ``qk_clip = true`` (:class:`QKClipAfterStep`)."""

    def __init__(self, model_parts: list[nn.Module], config: Any, parallel_dims: ParallelDims | None = None) -> None:
        kwargs = muon_kwargs(config)
        self.model_parts = model_parts
        pipeline = parallel_dims is not None and parallel_dims.pp_enabled
        # a non-finite gradient in any stage raises or skips in every stage
        stages = {"pipeline_group": parallel_dims.get_mesh("pp").get_group()} if pipeline else {}
        if config.demo:  # the optimizer owns the replicate dimension (FSDP2 runs on the fsdp mesh only)
            check_replicas(parallel_dims)
            stages["replicate_group"] = parallel_dims.get_mesh("dp_replicate").get_group()
        self.optimizers = [self._build(model, config, {**kwargs, **stages}, pipeline) for model in model_parts]
        self._validate_length(len(model_parts))
        params = [p for model in model_parts for p in model.parameters() if p.requires_grad]
        self._post_init(params, kwargs)
        self._build_qk_clips(model_parts, config, parallel_dims)

    def step(self, *args, **kwargs) -> None:
        """Every model part, after all parts' gradients were agreed on together (several parts per
        rank under interleaved schedules: all skip, raise or step as one); then MuonClip."""
        with agreeing_model_parts(self.optimizers):
            super().step(*args, **kwargs)

    @staticmethod
    def _build(model: nn.Module, config: Any, kwargs: dict[str, Any], pipeline: bool = False) -> Muon:
        return build_muon(model, config, kwargs, pipeline)

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """The last step's Muon metrics; with several model parts (pipeline parallel), bytes,
        times and FLOPs are summed over parts and the other values averaged."""
        return merged_step_metrics(self.optimizers) | self.qk_clip_step_metrics()


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: ParallelDims,
    **kwargs,
) -> OptimizersContainer:
    validate_optimizer_config(optimizer_config)
    if optimizer_config.name == "Muon":
        if optimizer_config.early_step_in_backward:
            raise ValueError('[optimizer] early_step_in_backward is not supported with name = "Muon"')
        optimizers = MuonOptimizersContainer(model_parts, optimizer_config, parallel_dims)
    else:
        optimizers = build_torchtitan_optimizers(model_parts, optimizer_config, parallel_dims, **kwargs)
    time_optimizer_steps(optimizers)
    measure_logged_steps_only(optimizers)
    return optimizers


@contextmanager
def _torchtitan_builder_replaced_by(builder):
    """Within the block, torchtitan's module-level ``build_optimizers`` is ``builder``."""
    module = torchtitan.components.optimizer
    original = module.build_optimizers
    module.build_optimizers = builder
    try:
        yield
    finally:
        module.build_optimizers = original


def build_optimizers_with_moe_load_balancing(model_parts, optimizer_config, parallel_dims, **kwargs):
    """torchtitan's ``build_optimizers_with_moe_load_balancing``, building our container for Muon.

    torchtitan's function builds the optimizers with its module-level ``build_optimizers`` and
    then registers the expert-bias update as a step pre-hook; the hook is a closure, so the
    only way to reuse it rather than copy it is to have that function build our optimizers:
    the name is rebound for the duration of this one call (single-threaded setup) and
    restored afterwards. Our builder sends names other than "Muon" back to torchtitan's own.
    """
    with _torchtitan_builder_replaced_by(build_optimizers):
        return torchtitan.components.optimizer.build_optimizers_with_moe_load_balancing(
            model_parts, optimizer_config, parallel_dims, **kwargs
        )
