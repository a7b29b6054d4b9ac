"""Pipeline parallel: gradients normalized like the non-pipelined run (torchtitan 0.2.2).

torchtitan's losses are sums over tokens (``reduction="sum"``). Without pipelining its
trainer divides the sum by the step's global valid-token count N before ``backward()``.
With pipelining the schedule calls the loss function and runs backward itself, on the raw
sum; torchtitan divides by N only afterwards, for the loss it reports
(pytorch/torchtitan#2972, fixed upstream after 0.2.2). The gradients, and the grad norm
that clipping and logging see, are then N times too large.

:class:`PipelineLoss` is the loss the schedule calls: its value is torchtitan's sum,
unchanged (so the reported training and validation losses are torchtitan's own), and the
gradient flowing back from it is divided by N, as ``(loss_sum / N).backward()`` divides
it. ``titan_muon.torchtitan.train.Trainer`` sets N before every forward/backward.
"""

from collections.abc import Callable
from typing import Any

from torch import Tensor


class PipelineLoss:
    """A sum-reduced loss whose gradient is divided by the step's global valid-token count."""

    def __init__(self, loss_fn: Callable[..., Tensor]) -> None:
        self.loss_fn = loss_fn
        self.global_valid_tokens: Tensor | float | None = None

    def __call__(self, pred: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        loss_sum = self.loss_fn(pred, labels, **kwargs)
        if loss_sum.requires_grad:  # training; validation runs without autograd
            if self.global_valid_tokens is None:
                raise RuntimeError(
                    "PipelineLoss: the step's global valid-token count was not set; pipeline parallel "
                    "training must run through titan_muon.torchtitan.train.Trainer"
                )
            divisor = self.global_valid_tokens
            # The root of the schedule's backward: its incoming gradient is 1, and 1 / N is
            # what the division in the non-pipelined loss passes back.
            loss_sum.register_hook(lambda grad: grad / divisor)
        return loss_sum


def pipeline_loss_builder(build_loss_fn: Callable[..., Callable]) -> Callable[..., Callable]:
    """A train spec's ``build_loss_fn`` that wraps the loss in :class:`PipelineLoss` under PP only."""

    def build(job_config, **kwargs):
        loss_fn = build_loss_fn(job_config, **kwargs)
        parallel_dims = kwargs.get("parallel_dims")
        return PipelineLoss(loss_fn) if parallel_dims is not None and parallel_dims.pp_enabled else loss_fn

    return build


def set_global_valid_tokens(loss_fn: Callable, global_valid_tokens: Tensor | float) -> None:
    """Give a :class:`PipelineLoss` the count of the step about to run (any other loss: no-op)."""
    if isinstance(loss_fn, PipelineLoss):
        loss_fn.global_valid_tokens = global_valid_tokens


def check_pipeline_loss(loss_fn: Callable, pp_enabled: bool, model_name: str) -> None:
    """Refuse pipeline parallel with a loss that would backpropagate the raw token sum."""
    if pp_enabled and not isinstance(loss_fn, PipelineLoss):
        raise ValueError(
            f"[parallelism] pipeline_parallel_degree > 1 with [model] name = {model_name!r}: torchtitan 0.2.2's "
            "pipeline schedule backpropagates the loss summed over tokens, not divided by their count "
            "(pytorch/torchtitan#2972), so gradients would be token-count times too large. Use a titan_muon "
            "train spec (titan_muon_llama3, titan_muon_mla), whose loss divides the gradient (docs/torchtitan.md)."
        )

