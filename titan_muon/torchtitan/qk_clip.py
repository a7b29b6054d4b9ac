"""MuonClip under torchtitan's parallelisms: which ranks reduce max logits together.

A max logit must be reduced over exactly the ranks that hold the same attention layers:

* no pipeline parallel: every rank holds every layer, so the world (data parallel, HSDP,
  tensor parallel: MAX merges the heads each TP rank recorded);
* pipeline parallel: only the ranks of this rank's stage, i.e. the product of its
  ``dp_replicate``, ``fsdp`` and ``tp`` mesh dimensions (one MAX all-reduce each), never the
  ``pp`` dimension: stages hold different layers. A model part without attention (a stage of
  norm + output) is skipped alike on every rank of its stage;
* context parallel (torchtitan 0.2.2, SDPA or FlexAttention; 0.3.0, SDPA): each rank's attention sees only
  its slice of the sequence, so the recorder gathers every CP rank's keys and masks them by
  their global positions (:class:`~titan_muon.attention.logits.ContextParallelSequence`, built
  here from the ``cp`` mesh and torchtitan's load balancer). The reduction group already
  includes the CP ranks: torchtitan's ``fsdp`` dimension is ``dp_shard`` times ``cp``.
  torchtitan 0.3.0 cuts the sequence alike; its FlexAttention under context parallel is
  refused (:func:`refuse_context_parallel_030`).

:class:`QKClipAfterStep` is the part of an optimizers container (torchtitan 0.2.2's and 0.3.0's
alike) that builds the clips for its model parts and runs them after each step.
"""

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.distributed import ParallelDims

from titan_muon.attention.clip import QKClip, QKClipMetrics, build_qk_clips, read_metrics
from titan_muon.attention.logits import ContextParallelSequence

STAGE_DIMS = ("dp_replicate", "fsdp", "tp")


DEFAULT_CONTEXT_PARALLEL_LOAD_BALANCER = "headtail"
"""torchtitan 0.2.2's default ``[parallelism] context_parallel_load_balancer`` (its SDPA sharding)."""


def refuse_context_parallel_030(context_parallel_degree: int, flex_attention: bool) -> None:
    """Refuse what the recorder cannot read of torchtitan 0.3.0's context parallel: FlexAttention.

    0.3.0 (``apply_cp_to_forward``) replaces each inner attention's ``forward`` by a wrapper. Under
    SDPA the wrapper only wraps this rank's q, k and v as DTensors sharded along the sequence, cut
    as 0.2.2 cuts it (the same ``_HeadTailLoadBalancer``, or contiguous slices): the recorder's
    hook, which runs before it, sees this rank's plain slices and gathers the keys itself, as
    under 0.2.2. Under FlexAttention the wrapper all-gathers the keys itself, after that hook, and
    the sharded BlockMask numbers them in that gathered order: the hook would see this rank's keys
    only, which 0.2.2's FlexAttention path (keys gathered before the hook) does not handle.
    """
    if context_parallel_degree > 1 and flex_attention:
        raise ValueError(
            f"optimizer.qk_clip cannot be used with parallelism.context_parallel_degree = {context_parallel_degree} "
            "and FlexAttention under torchtitan 0.3.0: 0.3.0 all-gathers the keys inside the attention's wrapped "
            "forward, after the max-logit recorder's hook, which would see this rank's keys only and miss every "
            "query/key pair across ranks. Use SDPA attention (context_parallel_load_balancer = 'headtail' or none), "
            "set qk_clip = false or context_parallel_degree = 1, or use torchtitan 0.2.2."
        )


def context_parallel_sequence(
    parallel_dims: ParallelDims, load_balancer: str | None = DEFAULT_CONTEXT_PARALLEL_LOAD_BALANCER
) -> ContextParallelSequence | None:
    """How the sequence is cut over this rank's ``cp`` mesh, or None without context parallel."""
    if parallel_dims.cp <= 1:
        return None
    return ContextParallelSequence(parallel_dims.get_mesh("cp").get_group(), load_balancer)


def use_context_parallel_load_balancer(qk_clips: Sequence[QKClip | None], load_balancer: str | None) -> None:
    """Tell clips built by :func:`build_model_part_qk_clips` (which sees only the optimizer config, so
    assumes torchtitan's default) the run's ``[parallelism] context_parallel_load_balancer``."""
    for clip in qk_clips:
        if clip is not None and clip.recorder.context_parallel is not None:
            group = clip.recorder.context_parallel.group
            clip.recorder.context_parallel = ContextParallelSequence(group, load_balancer)


def qk_clip_group(parallel_dims: ParallelDims) -> list[dist.ProcessGroup] | None:
    """The groups whose product is this rank's pipeline stage; None (the world) without PP.
    Both hold the context-parallel ranks (``fsdp`` is ``dp_shard`` x ``cp``)."""
    if not parallel_dims.pp_enabled:
        return None
    meshes = (parallel_dims.get_optional_mesh(name) for name in STAGE_DIMS)
    return [mesh.get_group() for mesh in meshes if mesh is not None]


def build_model_part_qk_clips(
    model_parts: Sequence[nn.Module], config: Any, parallel_dims: ParallelDims | None = None
) -> list[QKClip | None]:
    """One QKClip per model part (None where a pipeline stage's part has no attention)."""
    group = None if parallel_dims is None else qk_clip_group(parallel_dims)
    pipeline = parallel_dims is not None and parallel_dims.pp_enabled
    context_parallel = None if parallel_dims is None else context_parallel_sequence(parallel_dims)
    return build_qk_clips(
        model_parts,
        config.qk_clip_tau,
        config.qk_clip_alpha,
        group,
        fused={"auto": None, "kernel": True, "blocks": False}[config.qk_clip_recording],
        allow_parts_without_attention=pipeline,
        context_parallel=context_parallel,
    )


class QKClipAfterStep:
    """MuonClip in an optimizers container holding one optimizer per model part (``self.optimizers``).

    Put before torchtitan's ``OptimizersContainer`` in the bases and call :meth:`_build_qk_clips`
    in ``__init__``: ``step`` then runs every optimizer, then each part's :class:`QKClip` (one MAX
    all-reduce, the clip, the reset) on the weights they produced, never at lr = 0. Its metrics
    stay on the device until :meth:`qk_clip_step_metrics` reads them (logging steps only). Torch's
    optimizer step hooks (step time, MoE load balancing) wrap this ``step``, clip included.
    """

    qk_clips: list[QKClip | None]
    qk_clip_metrics: list[QKClipMetrics]

    def _build_qk_clips(self, model_parts: Sequence[nn.Module], config: Any, parallel_dims: ParallelDims | None = None):
        """The clips of ``config.qk_clip`` (none when off), after the model parts are sharded."""
        self.qk_clips = build_model_part_qk_clips(model_parts, config, parallel_dims) if config.qk_clip else []
        self.qk_clip_metrics = []

    def step(self, *args, **kwargs) -> None:
        """Every optimizer, then MuonClip on the weights they produced (never at lr = 0)."""
        super().step(*args, **kwargs)
        pairs = zip(self.qk_clips, self.optimizers)
        self.qk_clip_metrics = [qk_clip.reduce_and_clip(optimizer) for qk_clip, optimizer in pairs if qk_clip is not None]

    def qk_clip_step_metrics(self) -> dict[str, float]:
        """The last step's ``qk_clip/*`` metrics (one device-to-host copy), {} with MuonClip off."""
        return read_metrics(self.qk_clip_metrics)


def record_only_stage_forwards(schedule, qk_clips: Sequence[QKClip | None]) -> None:
    """Under pipeline parallel, record max logits only in the stages' real forwards.

    Before its first step (and again after each evaluation) torch's pipeline schedule runs a
    metadata-inference forward through every stage, in training mode, on inputs it makes
    with ``torch.empty``: uninitialized memory. Recording that forward would take garbage
    for a max logit (NaN, or a large finite value that clips healthy heads). Real
    microbatches go through each stage's public ``forward_one_chunk``, the inference does
    not, so recording is switched on only inside it. Activation recompute in backward is not
    recorded either: it repeats the same forward, and a max is idempotent.
    """
    recorders = [clip.recorder for clip in qk_clips if clip is not None]
    if not recorders:
        return
    stages = getattr(schedule, "_stages", None) or ([schedule._stage] if hasattr(schedule, "_stage") else None)
    if not stages or not all(hasattr(stage, "forward_one_chunk") for stage in stages):
        raise RuntimeError(
            "[optimizer] qk_clip = true under pipeline parallel needs the schedule's stages (torch's PipelineStage."
            "forward_one_chunk) to tell real forwards from its shape-inference forward, and this torch version does not "
            f"expose them on {type(schedule).__name__}. Set qk_clip = false or pipeline_parallel_degree = 1."
        )
    for recorder in recorders:
        recorder.enabled = False
    for stage in stages:
        forward = stage.forward_one_chunk

        def recording_forward(*args, _forward=forward, **kwargs):
            for recorder in recorders:
                recorder.enabled = True
            try:
                return _forward(*args, **kwargs)
            finally:
                for recorder in recorders:
                    recorder.enabled = False

        stage.forward_one_chunk = recording_forward
