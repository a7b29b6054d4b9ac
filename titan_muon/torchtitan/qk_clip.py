"""MuonClip under torchtitan's parallelisms: which ranks reduce max logits together.

A max logit must be reduced over exactly the ranks that hold the same attention layers:

* no pipeline parallel: every rank holds every layer, so the world (data parallel, HSDP,
  tensor parallel: MAX merges the heads each TP rank recorded);
* pipeline parallel: only the ranks of this rank's stage, i.e. the product of its
  ``dp_replicate``, ``fsdp`` and ``tp`` mesh dimensions (one MAX all-reduce each), never the
  ``pp`` dimension: stages hold different layers. A model part without attention (a stage of
  norm + output) is skipped alike on every rank of its stage;
* context parallel: refused. Each rank's attention sees only its slice of the sequence, so
  recorded maxima would miss the query/key pairs across slices.
"""

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.distributed import ParallelDims

from titan_muon.clip import QKClip, build_qk_clips

STAGE_DIMS = ("dp_replicate", "fsdp", "tp")


def qk_clip_group(parallel_dims: ParallelDims) -> list[dist.ProcessGroup] | None:
    """The groups whose product is this rank's pipeline stage; None (the world) without PP."""
    if parallel_dims.cp_enabled:
        raise ValueError(
            f"[optimizer] qk_clip = true cannot be used with [parallelism] context_parallel_degree = {parallel_dims.cp}: "
            "under context parallelism each rank's attention sees only its slice of the queries and keys, so the "
            "recorded max logits would miss the pairs across slices. Set qk_clip = false or context_parallel_degree = 1."
        )
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
    return build_qk_clips(
        model_parts, config.qk_clip_tau, config.qk_clip_alpha, group, allow_parts_without_attention=pipeline
    )
