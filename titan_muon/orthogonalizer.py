"""Newton–Schulz as the step runs it: a param group's settings, batched shapes, scaled updates."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from titan_muon.newton_schulz import newton_schulz_flops, orthogonalize, resolve_algorithm
from titan_muon.timing import StepTimer, phase
from titan_muon.update import update_scale


# Peak bytes orthogonalize() allocates (copies in the NS dtype, Gram products, polynomial, the
# fp32 result) per byte of its fp32 input, measured with a storage-lifetime mode on CPU
# (tests/test_meta_device.py::test_peak_transient_bytes_bound_what_is_really_alive): at most
# 5.6 in fp32 (Gram NS on a near-square batch) and 3.3 in bf16.
NS_WORKSPACE = {torch.float32: 6.0, torch.bfloat16: 3.5}


class Orthogonalizer:
    """Runs batches of equal-shape matrices of one param group (``key = ((rows, cols), group
    index)``) through Newton–Schulz in ``ns_dtype`` and scales them by their shape's factor;
    results stay in ``ns_dtype``."""

    def __init__(self, param_groups: Callable[[], list[dict]], ns_dtype: torch.dtype, device: torch.device):
        # a getter: torch's Optimizer.load_state_dict replaces the optimizer's list of groups
        self.param_groups, self.ns_dtype, self.device = param_groups, ns_dtype, device

    def algorithm(self, group: dict, rows: int, cols: int) -> str:
        algorithm = group["ns_algorithm"]
        return resolve_algorithm(rows, cols, self.ns_dtype, self.device.type) if algorithm == "auto" else algorithm

    def flops(self, group: dict, rows: int, cols: int) -> int:
        """What an owner spends on one (rows, cols) matrix of `group`: the plan balances owners on this."""
        return newton_schulz_flops(rows, cols, group["ns_steps"], self.algorithm(group, rows, cols))

    def __call__(self, key: tuple, matrices: Tensor, timer: StepTimer, work) -> Tensor:
        shape, group_index = key
        group = self.param_groups()[group_index]
        steps, algorithm = group["ns_steps"], self.algorithm(group, *shape)
        timer.start("ns")
        with phase("newton_schulz"):
            ortho = orthogonalize(matrices, steps, group["ns_coefficients"], self.ns_dtype, group["ns_eps"], algorithm)
        timer.stop("ns")
        work.ns_flops += matrices.shape[0] * newton_schulz_flops(*shape, steps, algorithm)
        with phase("scale"):
            # In the NS dtype, the value the wire carries anyway, into a row-major buffer: NS returns
            # tall matrices transposed, and the return buffer is cut from them by rows.
            scaled = torch.mul(ortho, update_scale(group["adjust_lr_fn"], *shape), out=torch.empty_like(ortho, memory_format=torch.contiguous_format))
            work.update_sq.append(torch.linalg.vector_norm(scaled, dtype=torch.float32).square() * group["lr"] ** 2)
        work.update_numel += scaled.numel()
        return scaled
