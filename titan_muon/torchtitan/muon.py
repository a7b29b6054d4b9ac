"""From the ``[optimizer]`` fields to one :class:`titan_muon.Muon` per model part.

Shared by the torchtitan 0.2.2 container (titan_muon.torchtitan.v022.optimizer) and the 0.3.0 one
(titan_muon.torchtitan.v030.optimizer): ``config`` is anything with the fields of
titan_muon.torchtitan.config (plus torchtitan's ``lr``, ``weight_decay``, ``beta1``,
``beta2``, ``eps`` and ``implementation``). Nothing here imports torchtitan.
"""

import logging
from typing import Any

import torch.nn as nn

from titan_muon import Muon, build_param_groups
from titan_muon.attention.split import RowBlocks, attention_row_blocks
from titan_muon.metrics import merge_part_metrics
from titan_muon.param_groups import fqn_pattern

logger = logging.getLogger(__name__)


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
        commit=config.commit,
        keep_reservation={"auto": None, "on": True, "off": False}[config.keep_reservation],
        overlap=config.overlap,
        demo=config.demo,
        demo_chunk=config.demo_chunk,
        demo_topk=config.demo_topk,
        demo_alpha=config.demo_alpha,
        demo_shared_momentum=config.demo_shared_momentum,
        demo_compressor=config.demo_compressor,
        demo_rank=config.demo_rank,
        demo_adamw=config.demo_adamw,
        hierarchical_exchange={"auto": "auto", "on": True, "off": False}[config.hierarchical_exchange],
        ranks_per_node=config.ranks_per_node,
    )


def param_group_kwargs(config: Any) -> dict[str, Any]:
    return dict(
        adamw_lr=config.adamw_lr,
        adamw_weight_decay=config.adamw_weight_decay,
        adamw_patterns=config.adamw_patterns,
        muon_patterns=config.muon_patterns,
        unclassified=config.unclassified_params,
    )


def build_muon(model: nn.Module, config: Any, kwargs: dict[str, Any], pipeline: bool = False) -> Muon:
    """One model part's Muon, with its own Muon / AdamW split (``kwargs``: :func:`muon_kwargs`)."""
    groups = build_param_groups(model, **param_group_kwargs(config))  # the model: module types help classify
    muon_names = {name for group in groups if group["use_muon"] for name in group["param_names"]}
    # Split only what is optimized by Muon: adamw_patterns may have moved attention weights.
    # A pipeline stage may hold no attention layer (embeddings only, or norm + output).
    row_blocks = attention_row_blocks(model, config.split, missing_ok=pipeline)
    blocks = {name: rows for name, rows in row_blocks.items() if name in muon_names}
    if blocks:
        logger.info("titan_muon split = %r: %s", config.split, describe_row_blocks(model, blocks))
    return Muon(groups, row_blocks=blocks, **kwargs)


def describe_row_blocks(model: nn.Module, blocks: dict[str, RowBlocks]) -> str:
    """One entry per parameter pattern: its rows as repeats of the row-block sizes, e.g.
    ``layers.*.attention.wq_b.weight 96 rows = 4 x (16 | 8)`` (MLA's q_nope | q_rope, split = "fine")."""
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    entries = []
    for name, pattern in blocks.items():
        sizes = (pattern,) if isinstance(pattern, int) else tuple(pattern)
        rows = shapes[name][-2]
        entry = f"{fqn_pattern(name)} {rows} rows = {rows // sum(sizes)} x ({' | '.join(map(str, sizes))})"
        if entry not in entries:  # the same parameter of every layer
            entries.append(entry)
    return "; ".join(entries)


def merged_step_metrics(optimizers: list[Muon]) -> dict[str, float]:
    """The last step's Muon metrics over model parts (several per rank under pipeline
    parallel), each merged by its rule (titan_muon.metrics.PART_MERGE_RULES): amounts summed,
    peaks the largest, ratios weighted by what they are per."""
    return merge_part_metrics([opt.last_step_metrics for opt in optimizers])
