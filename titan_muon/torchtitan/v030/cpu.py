"""Run torchtitan 0.3.0 on torch 2.13, and on CPU processes talking over gloo.

torchtitan 0.3.0 is released against torch 2.14; on torch 2.13 and without a GPU it needs:

1. :func:`add_set_timeout` (torch 2.13, any device): torchtitan shortens every process group's
   timeout after the first step with ``torch.distributed.set_timeout``, which torch 2.13 does
   not have; torch 2.13's ``_set_pg_timeout`` does the same (gloo and NCCL).
2. :func:`adapt_config` (CPU): ``parallelism.spmd_backend = "partial_dtensor"`` (the default
   "spmd_types" backend does not run on torch 2.13's CPU build), SDPA attention instead of
   FlexAttention / varlen attention (neither runs on CPU here; SDPA is causal over the whole
   packed sequence, where FlexAttention masks each document: the loss differs a little from a
   GPU run), and CUDA graphs off (``training.disable_cuda_graphs``).
3. :func:`use_cpu_device` (CPU): torchtitan reads the device once, at import, as
   ``_get_available_device_type() or "cuda"``; the modules that imported that choice are pointed
   at the CPU (and thus gloo), as titan_muon.torchtitan.cpu does for 0.2.2, and ``torch.histc``
   counts integers on CPU (MoE token counts per expert), and ``[checkpoint] async_mode =
   "async_with_pinned_mem"`` stages without pinned memory and non-blocking copies, which torch
   refuses without an accelerator (:func:`titan_muon.torchtitan.cpu.stage_checkpoints_without_accelerator`).
4. :func:`titan_muon.torchtitan.cpu.force_sum_reductions` (CPU, after the model is sharded):
   torchtitan turns FSDP's gradient division off, and FSDP then asks gloo for ``PREMUL_SUM``,
   which gloo lacks; with a factor of 1 a SUM is the same math.
5. :func:`accept_microbatch_lists` (torch 2.13, any device, pipeline parallel): torchtitan calls
   ``schedule.step`` / ``eval`` with the microbatches already split (``arg_mbs``, ``kwarg_mbs``,
   ``target_mbs``), torch 2.14's interface; torch 2.13's schedules take the whole batch and split
   it themselves.

titan_muon.torchtitan.v030.trainer applies all of them; on a CUDA machine the first and the last.
"""

import inspect

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
)
from torchtitan.tools.logging import logger

from titan_muon.torchtitan.cpu import (  # noqa: F401
    count_integers_on_cpu,
    force_sum_reductions,
    rebind_device,
    stage_checkpoints_without_accelerator,
)

# the torchtitan 0.3.0 modules that import device_type / device_module from torchtitan.tools.utils
DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)


def should_use_cpu() -> bool:
    return not torch.cuda.is_available()


def add_set_timeout() -> None:
    """``torch.distributed.set_timeout(timeout, group=None)`` where torch lacks it (2.13)."""
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout, group=None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


def accept_microbatch_lists(schedule) -> None:
    """Let torch 2.13's pipeline ``schedule`` take torch 2.14's pre-split microbatches.

    ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., **rest)`` becomes torch 2.13's
    ``step(*whole_batch_args, target=whole_batch_target, **whole_batch_kwargs, **rest)``: each
    tensor concatenated over the microbatches along the batch dimension, which the schedule splits
    back into the same microbatches (torchtitan's are of equal size). ``eval`` calls ``step``, so it
    is covered too. A schedule that already takes microbatch lists is left alone.
    """
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return
    whole_batch_step = schedule.step

    def step(*args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, target=None, **rest):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(*args, target=target, **rest)
        if args or target is not None:  # eval() passes target=None along
            raise TypeError("schedule.step: give either the whole batch or the microbatch lists, not both")
        whole_args = tuple(torch.cat(parts) for parts in zip(*arg_mbs)) if arg_mbs else ()
        whole_kwargs = _concatenated_kwargs(kwarg_mbs or [])
        target = torch.cat(target_mbs) if target_mbs else None
        return whole_batch_step(*whole_args, target=target, **whole_kwargs, **rest)

    schedule.step = step


def _concatenated_kwargs(kwarg_mbs: list[dict]) -> dict:
    """The microbatches' model keyword arguments as one batch: tensors concatenated, any other
    value (the same in every microbatch) passed once."""
    whole = {}
    for name in kwarg_mbs[0] if kwarg_mbs else ():
        values = [kwargs[name] for kwargs in kwarg_mbs]
        if all(isinstance(value, torch.Tensor) for value in values):
            whole[name] = torch.cat(values)
        elif all(value is values[0] for value in values):
            whole[name] = values[0]
        else:
            raise TypeError(
                f"pipeline parallel on torch 2.13: model argument {name!r} ({type(values[0]).__name__}) differs "
                "between microbatches and cannot be joined into one batch; torch 2.14 takes microbatch lists"
            )
    return whole


def use_cpu_device() -> None:
    rebind_device(DEVICE_MODULES)
    count_integers_on_cpu()
    stage_checkpoints_without_accelerator("torchtitan.components.checkpointer.dcp")


def use_sdpa_attention(config) -> list[str]:
    """Replace every FlexAttention / varlen attention config under ``config`` (a Trainer.Config
    or a ModelSpec) by SDPA; returns the FQNs replaced."""
    replaced = []
    for kind in (FlexAttention.Config, VarlenAttention.Config):
        for fqn, _, parent, attr in list(config.traverse(kind)):
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())
            replaced.append(fqn)
    return replaced


def adapt_config(config) -> list[str]:
    """Set what a ``Trainer.Config`` needs on CPU (see the module docstring); idempotent.
    Returns a description of each change made."""
    changes = []
    if config.parallelism.spmd_backend != "partial_dtensor":
        changes.append(f'parallelism.spmd_backend {config.parallelism.spmd_backend!r} -> "partial_dtensor"')
        config.parallelism.spmd_backend = "partial_dtensor"
    if not config.training.disable_cuda_graphs:
        changes.append("training.disable_cuda_graphs -> True")
        config.training.disable_cuda_graphs = True
    if config.model_spec is not None:
        replaced = use_sdpa_attention(config.model_spec)
        if replaced:
            changes.append(f"attention -> SDPA in {len(replaced)} layers")
    return changes


def prepare(config) -> None:
    """Everything needed before torchtitan's Trainer is built with ``config``."""
    add_set_timeout()
    if should_use_cpu():
        use_cpu_device()
        changes = adapt_config(config)
        if changes:
            logger.info("titan_muon: CPU run of torchtitan 0.3.0: " + "; ".join(changes))
