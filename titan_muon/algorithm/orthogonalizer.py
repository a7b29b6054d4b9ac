"""Newton–Schulz as the step runs it: a param group's settings, batched shapes, scaled updates."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from titan_muon.algorithm.newton_schulz import (
    FP16_PEAK_LIMIT,
    Blocks,
    Pieces,
    NSPrecision,
    half_precision_peak,
    newton_schulz_flops,
    orthogonalize,
    workspace_bytes,
)
from titan_muon.algorithm.update import commit_scale, update_scale
from titan_muon.buffers import Buffers, FreshBuffers
from titan_muon.timing import StepTimer, phase


# A batch runs through Newton–Schulz in chunks whose workspace (one copy of the chunk in the NS
# dtype, its Gram products; the results are the caller's) stays within this, one matrix at least: NS's transient memory no longer
# grows with how many equal matrices an owner holds. Large matrices lose nothing by it (one H100,
# 2026-11-27: one 4096 × 14336 matrix takes 9.0 / 6.9 ms in standard bf16 / fp16 Gram NS, a batch
# of 8 takes 8.8 / 6.8 ms per matrix); small ones still batch by the hundred.
NS_CHUNK_BYTES = 512 << 20


class Orthogonalizer:
    """Runs batches of equal-shape matrices of one param group (``key = ((rows, cols), group
    index)``) through Newton–Schulz and scales them by their shape's factor; results stay in
    the NS dtype. ``ns_precision``: the compute dtypes of standard and Gram NS (a single dtype
    means both)."""

    def __init__(self, param_groups: Callable[[], list[dict]], ns_precision: NSPrecision | torch.dtype, device: torch.device):
        # a getter: torch's Optimizer.load_state_dict replaces the optimizer's list of groups
        if isinstance(ns_precision, torch.dtype):
            ns_precision = NSPrecision(ns_precision, ns_precision)
        self.param_groups, self.ns_precision, self.device = param_groups, ns_precision, device

    def plan(self, group: dict, rows: int, cols: int) -> tuple[str, torch.dtype]:
        """(algorithm, compute dtype) for one (rows, cols) matrix of `group`. A schedule whose
        intermediates could leave fp16's range (half_precision_peak; never Keller or Polar
        Express) runs in bf16 instead: same width, fp32's range."""
        algorithm, dtype = self.ns_precision.resolve(rows, cols, group["ns_algorithm"], self.device.type)
        if dtype == torch.float16 and half_precision_peak(group["ns_coefficients"], group["ns_steps"], algorithm) > FP16_PEAK_LIMIT:
            dtype = torch.bfloat16
        return algorithm, dtype

    def plan_settings(self) -> tuple:
        """The group settings :meth:`plan` reads, for every group: what a layout derived from the
        plans (the streaming step's reservation) must be computed again for when it changes."""
        return tuple((g.get("ns_algorithm"), repr(g.get("ns_coefficients")), g.get("ns_steps")) for g in self.param_groups())

    def algorithm(self, group: dict, rows: int, cols: int) -> str:
        return self.plan(group, rows, cols)[0]

    def flops(self, group: dict, rows: int, cols: int) -> int:
        """What an owner spends on one (rows, cols) matrix of `group`: the plan balances owners on this."""
        return newton_schulz_flops(rows, cols, group["ns_steps"], *self.plan(group, rows, cols), self.device.type)

    def chunks(self, key: tuple, count: int) -> list[slice]:
        """A batch of `count` matrices cut into runs of equal length (the last shorter) whose
        workspace stays within NS_CHUNK_BYTES, at least one matrix each."""
        per_matrix = self.workspace_bytes(key, 1)
        size = max(1, min(count, NS_CHUNK_BYTES // max(per_matrix, 1)))
        size = -(-count // -(-count // size))  # as many chunks as needed, of even size
        return [slice(start, min(start + size, count)) for start in range(0, count, size)]

    def workspace_bytes(self, key: tuple, count: int, reserved: bool = False, spare: bool = False) -> int:
        """What orthogonalizing a batch of `count` matrices holds at its peak besides its results
        (newton_schulz.workspace_bytes; ``reserved``: as cut from an Arena; ``spare``: results
        written into blocks with a spare iterate of NS's own)."""
        shape, group_index = key
        algorithm, dtype = self.plan(self.param_groups()[group_index], *shape)
        return workspace_bytes(count, *shape, algorithm, dtype, self.device.type, reserved=reserved, spare=spare)

    def result_dtype(self, key: tuple) -> torch.dtype:
        shape, group_index = key
        return self.plan(self.param_groups()[group_index], *shape)[1]

    def writes_blocks(self, key: tuple, dtype: torch.dtype) -> bool:
        """Whether results due in `dtype` are written straight into their blocks (a return buffer's
        pieces) by Newton–Schulz's last products instead of copied there afterwards: where NS runs one
        matrix at a time (a CPU) and computes in `dtype`. On GPUs a batch's last product stays one
        batched GEMM, which W pieces per matrix would cut into W."""
        return self.device.type == "cpu" and self.result_dtype(key) == dtype

    def reads_pieces(self, key: tuple, dtype: torch.dtype) -> bool:
        """Whether inputs arriving in `dtype` are read as :class:`Pieces` where they landed instead of
        assembled first: wherever results are written into blocks, except fp16 NS (which scales
        its input in fp32)."""
        return self.writes_blocks(key, dtype) and dtype != torch.float16

    def __call__(self, key: tuple, matrices: Tensor | list[Pieces], timer: StepTimer, work, out: Tensor | list[Blocks] | None = None,
                 buffers: Buffers | None = None, spare: Tensor | None = None) -> Tensor | list[Blocks]:  # fmt: skip
        """The updates of `matrices` as the owners return them, scaled by their shape's factor and
        commit_scale (−1/wd: the commit is then one lerp, update.py), written into `out` (default:
        taken from `buffers`; Blocks, one per matrix: writes_blocks, the iterates alternating with
        `spare`, newton_schulz.orthogonalize; for `matrices` given as Pieces, one per matrix:
        reads_pieces, always into Blocks); the workspace comes from `buffers` (default:
        allocated) and is given back. (The update's norm, muon/update_rms, is taken by the commit's
        pass, which reads every returned update anyway: commit.apply_updates.)"""
        shape, group_index = key
        group = self.param_groups()[group_index]
        steps, (algorithm, dtype) = group["ns_steps"], self.plan(group, *shape)
        device = matrices[0].device if isinstance(matrices, list) else matrices.device
        buffers = buffers if buffers is not None else FreshBuffers(device)
        timer.start("ns")
        with phase("newton_schulz"):
            # Scaled by NS's last product, row-major (the return buffer is cut from it by rows), in
            # the NS dtype: the value the wire carries anyway.
            scale = update_scale(group["adjust_lr_fn"], *shape) * commit_scale(group["weight_decay"])
            run = lambda m, o, s: orthogonalize(m, steps, group["ns_coefficients"], dtype, group["ns_eps"], algorithm,  # noqa: E731
                                                scale=scale, out=o, spare=s, buffers=buffers)  # fmt: skip
            if isinstance(matrices, list):
                for pieces, blocks in zip(matrices, out, strict=True):
                    run(pieces, blocks, None)
                scaled, count = out, len(matrices)
            else:
                scaled, count = run(matrices, out, spare), 1 if matrices.ndim == 2 else matrices.shape[0]
        timer.stop("ns")
        work.ns_flops += count * newton_schulz_flops(*shape, steps, algorithm, dtype, device.type)
        return scaled
