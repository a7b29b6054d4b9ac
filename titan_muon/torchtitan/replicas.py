"""``[optimizer] demo = true`` in torchtitan: the optimizer owns the replicate dimension.

DeMo (docs/demo.md) needs each replica's own gradients at ``step()``. torchtitan applies HSDP
(FSDP2 over the ``dp_replicate`` × ``fsdp`` mesh) or, without sharding, DDP over
``dp_replicate``; both average gradients over the replicas in backward. Two small changes,
both active only with ``demo = true``:

* **parallelize**: the train specs' ``parallelize_fn`` runs torchtitan's own with a view of
  ``ParallelDims`` whose replicate degree is 1 (:func:`without_replicas`), so FSDP2 is applied on
  the ``fsdp`` mesh only (and no DDP); the meshes themselves are unchanged, the optimizer gets
  ``dp_replicate``'s group;
* **loss scale**: torchtitan divides every rank's loss sum by the tokens of all data-parallel
  ranks, which HSDP's sum over replicas then completes. Without that sum a replica's gradient
  would be 1/R of its own. The trainer divides by the tokens / R instead (:func:`replica_tokens`)
  and reports the loss as torchtitan would. So each replica's gradient (and the norm that
  ``max_norm`` clips, per replica) is its own mean over its tokens, in proportion to its share of
  the tokens; their average — what AdamW gets, and what DeMo's momenta follow — is HSDP's gradient.
"""

from __future__ import annotations

from typing import Any

from torchtitan.distributed import ParallelDims


def demo_enabled(job_config: Any) -> bool:
    optimizer = job_config.optimizer
    return optimizer.name == "Muon" and bool(getattr(optimizer, "demo", False))


class _WithoutReplicas:
    """``ParallelDims`` as seen by a parallelize function that must not reduce over replicas."""

    def __init__(self, dims: ParallelDims):
        self._dims = dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)

    dp_replicate = 1
    dp_replicate_enabled = False

    @property
    def dp_enabled(self) -> bool:
        return self._dims.dp_shard > 1

    @property
    def fsdp_gradient_divide_factor(self) -> int:  # MoE models: FSDP divides by its own group only
        return self._dims.dp_shard * self._dims.cp


def without_replicas(dims: ParallelDims):
    return _WithoutReplicas(dims)


def check_replicas(dims: ParallelDims) -> None:
    if not dims.dp_replicate_enabled:
        raise ValueError(
            "[optimizer] demo = true needs replicas: set [parallelism] data_parallel_replicate_degree >= 2 "
            f"(got {dims.dp_replicate}); DeMo replaces the gradient all-reduce between them"
        )


def parallelize_for_demo(parallelize_fn):
    """``parallelize_fn`` that, with ``[optimizer] demo = true``, shards over the ``fsdp`` mesh only."""

    def parallelize(model, parallel_dims: ParallelDims, job_config):
        if not demo_enabled(job_config):
            return parallelize_fn(model, parallel_dims, job_config)
        check_replicas(parallel_dims)
        return parallelize_fn(model, without_replicas(parallel_dims), job_config)

    parallelize.__wrapped__ = parallelize_fn
    return parallelize


def replica_tokens(global_valid_tokens, demo: bool, dims: ParallelDims):
    """(tokens to divide the loss by, factor to multiply the returned loss by) — see the module doc.
    ``demo``: whether the optimizer owns the replicas (0.2.2: :func:`demo_enabled`; 0.3.0: its config)."""
    if not demo:
        return global_valid_tokens, 1.0
    return global_valid_tokens / dims.dp_replicate, 1.0 / dims.dp_replicate
