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
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers as build_torchtitan_optimizers
from torchtitan.distributed import ParallelDims

from titan_muon import Muon, build_param_groups
from titan_muon.clip import QKClipMetrics, read_metrics
from titan_muon.split import attention_row_blocks
from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.metrics import time_optimizer_steps
from titan_muon.torchtitan.qk_clip import build_model_part_qk_clips


def muon_kwargs(config: Any) -> dict[str, Any]:
    return dict(
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.momentum,
        nesterov=config.nesterov,
        ns_steps=config.ns_steps,
        adjust_lr_fn=config.adjust_lr_fn,
        ns_coefficients=config.ns_coefficients,
        ns_algorithm=config.ns_algorithm,
        ns_dtype=config.ns_dtype,
        comm_dtype=config.comm_dtype,
        momentum_dtype=config.momentum_dtype,
        adamw_betas=(config.beta1, config.beta2),
        adamw_eps=config.eps,
        adamw_implementation=config.implementation,
        exchange_memory_mb=config.exchange_memory_mb,
        rounds_in_flight=None if config.buckets_in_flight is not None else config.rounds_in_flight,
        bucket_size_mb=config.bucket_size_mb,
        buckets_in_flight=config.buckets_in_flight,
        nonfinite_grads=config.nonfinite_grads,
        overlap=config.overlap,
        hierarchical_exchange={"auto": "auto", "on": True, "off": False}[config.hierarchical_exchange],
        ranks_per_node=config.ranks_per_node,
    )


def param_group_kwargs(config: Any) -> dict[str, Any]:
    return dict(
        adamw_lr=config.adamw_lr,
        adamw_weight_decay=config.adamw_weight_decay,
        adamw_patterns=config.adamw_patterns,
        muon_patterns=config.muon_patterns,
    )


class MuonOptimizersContainer(OptimizersContainer):
    """One :class:`titan_muon.Muon` per model part, with its own Muon / AdamW split."""

    def __init__(self, model_parts: list[nn.Module], config: Any, parallel_dims: ParallelDims | None = None) -> None:
        kwargs = muon_kwargs(config)
        self.model_parts = model_parts
        pipeline = parallel_dims is not None and parallel_dims.pp_enabled
        # a non-finite gradient in any stage raises or skips in every stage
        stages = {"pipeline_group": parallel_dims.get_mesh("pp").get_group()} if pipeline else {}
        self.optimizers = [self._build(model, config, {**kwargs, **stages}, pipeline) for model in model_parts]
        self._validate_length(len(model_parts))
        params = [p for model in model_parts for p in model.parameters() if p.requires_grad]
        self._post_init(params, kwargs)
        self.qk_clips = build_model_part_qk_clips(model_parts, config, parallel_dims) if config.qk_clip else []
        self.qk_clip_metrics: list[QKClipMetrics] = []  # device tensors, read on logging steps only

    def step(self, *args, **kwargs) -> None:
        """Every optimizer, then MuonClip on the weights they produced (never at lr = 0)."""
        super().step(*args, **kwargs)
        pairs = zip(self.qk_clips, self.optimizers)
        self.qk_clip_metrics = [qk_clip.reduce_and_clip(optimizer) for qk_clip, optimizer in pairs if qk_clip is not None]

    @staticmethod
    def _build(model: nn.Module, config: Any, kwargs: dict[str, Any], pipeline: bool = False) -> Muon:
        groups = build_param_groups(model.named_parameters(), **param_group_kwargs(config))
        muon_names = {name for group in groups if group["use_muon"] for name in group["param_names"]}
        # Split only what is optimized by Muon: adamw_patterns may have moved attention weights.
        # A pipeline stage may hold no attention layer (embeddings only, or norm + output).
        row_blocks = attention_row_blocks(model, config.split, missing_ok=pipeline)
        blocks = {name: rows for name, rows in row_blocks.items() if name in muon_names}
        return Muon(groups, row_blocks=blocks, **kwargs)

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """The last step's Muon metrics; with several model parts (pipeline parallel), bytes,
        times and FLOPs are summed over parts and the other values averaged."""
        per_part = [opt.last_step_metrics for opt in self.optimizers]
        merged: dict[str, float] = {}
        for key in per_part[0]:
            values = [metrics.get(key, 0.0) for metrics in per_part]
            additive = any(word in key for word in ("bytes", "time", "flops"))
            merged[key] = sum(values) if additive else sum(values) / len(values)
        return merged | read_metrics(self.qk_clip_metrics)


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
