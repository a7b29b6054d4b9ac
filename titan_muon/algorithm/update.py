"""Muon's element-wise rules: pure tensor math on whatever block of a matrix a rank holds.

Only Newton–Schulz needs whole matrices; momentum, Nesterov, weight decay and the step
itself are element-wise, so they run on local blocks with no communication.

A step computes the matrix to orthogonalize from the gradient and the *old* momentum
(:func:`nesterov_input_into`) and writes the new momentum only at the commit, once every rank
has succeeded (:func:`momentum_update_`): both apply the same ``lerp``, so the momentum the
step used is the momentum it stores.

These passes are memory-bound, so their cost is the bytes they move. As separate torch ops the
Nesterov input reads and writes a temporary and then a cast copy (30 bytes per element with a
bf16 wire). Weight decay and the step are one pass even eagerly: the owners return each update
U multiplied by :func:`commit_scale` (−1/wd, folded into Newton–Schulz's last product, which
scales it anyway), so that (1 − lr·wd)·W − lr·U is ``lerp(W, −U/wd, lr·wd)``, one torch op.
Compiled, each pass is one kernel per block reading its inputs once and writing its output once
— what torch's fused optimizers do, written with torch's compiler instead of CUDA — and a step's
blocks go to it in lists, since each call of a compiled function costs the host far more than
the kernels it launches (:data:`COMPILED_LIST`). :class:`Elementwise`
holds both forms. The eager one is the reference and runs by default off CUDA (compiling costs
~20 s per list length on a CPU and gains less there: on the ~100M model at W = 2 it took the packing
from 61–66 to 55–57 ms per rank and the commit not at all, scripts/bench_beyond_ns.py, 2026-11-28); the compiled one computes the same
formulas up to fp32 rounding (the compiler may contract a multiply and an add into one fused
multiply-add). Scalars that change between steps (learning rate, decay, momentum β) enter as 0-dim
device tensors, so a schedule never recompiles, and shapes are dynamic, so uneven shards share a kernel.
"""

from __future__ import annotations

import functools
import math
import struct
import types

import torch
from torch import Tensor

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")


def update_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Multiplier on the learning rate for an orthogonalized (rows, cols) update.

    "original" (Keller Jordan, the default): sqrt(max(1, rows / cols)).
    "match_rms_adamw" (Moonlight): 0.2 * sqrt(max(rows, cols)), which gives the update the RMS
    of a typical AdamW update so AdamW's learning rate and weight decay carry over.
    "spectral_unclamped": sqrt(rows / cols) = sqrt(fan_out / fan_in), below 1 for wide matrices
    (torchtitan 0.3.0 DistMuon's ``_adjust_muon_learning_rate``, flex_shard/dist_muon.py).
    The first two are ``torch.optim.Muon``'s names and meanings; the third is DistMuon's.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected None or one of {ADJUST_LR_FNS}")


# Below this weight decay the commit takes two passes instead of folding 1/wd into the update,
# which would push returned values toward the wire dtype's range (bf16's and fp32's end at 3e38).
MIN_FOLDED_DECAY = 1e-12


def commit_scale(weight_decay: float) -> float:
    """What the owners multiply each update by, besides its shape's factor: −1/wd, so that the
    commit is one lerp (:meth:`Elementwise.decay_and_step_`); 1 without weight decay."""
    weight_decay = float(weight_decay)  # a one-element tensor decay, as torch.optim accepts for lr
    return -1.0 / weight_decay if weight_decay >= MIN_FOLDED_DECAY else 1.0


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value, on the host (no tensor, so no kernel to trace)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def _continues(previous: Tensor, t: Tensor) -> bool:
    """t starts where `previous` ends, in the same tensor's memory, both contiguous."""
    return (_root(t) is _root(previous) and t.dtype == previous.dtype and t.is_contiguous() and previous.is_contiguous()
            and t.storage_offset() == previous.storage_offset() + previous.numel())  # fmt: skip


def coalesce(rows: list[tuple[Tensor, ...]]) -> list[tuple[Tensor, ...]]:
    """Consecutive rows of blocks (say a weight block and its update) merged wherever every block
    of a row continues the previous row's block in memory: one flat view per run instead of one
    block each, so an element-wise pass over them is one kernel per run. An EP rank's experts
    are whole, adjacent matrices of one parameter and arrive adjacent in the exchange buffers:
    thousands of blocks become a few runs. Reads no values; other rows stay as they are."""
    runs: list[list[tuple[Tensor, ...]]] = []
    for row in rows:
        if runs and all(_continues(prev, t) for prev, t in zip(runs[-1][-1], row)):
            runs[-1].append(row)
        else:
            runs.append([row])
    merged = []
    for run in runs:
        if len(run) == 1:
            merged.append(run[0])
            continue
        numel = sum(t.numel() for t in (row[0] for row in run))
        merged.append(tuple(first.as_strided((numel,), (1,), first.storage_offset()) for first in run[0]))
    return merged


def _into(out: Tensor, value_fn, *args) -> None:
    """out ← value, computed straight into an fp32 `out` (``out=``) or rounded once into another dtype."""
    if out.dtype == torch.float32:
        value_fn(*args, out=out)
    else:
        out.copy_(value_fn(*args))


def nesterov_input_into(out: Tensor, grad: Tensor, momentum: Tensor, beta: float | Tensor, nesterov: bool) -> None:
    """out ← the Nesterov input g + β(lerp(M, g, 1−β) − g) (or lerp(M, g, 1−β) without Nesterov),
    in out's dtype (the wire's), rounded once; `momentum` is left as it is."""
    grad = grad.float()
    if not nesterov:
        _into(out, torch.lerp, momentum, grad, 1 - beta)
        return
    _into(out, torch.lerp, grad, torch.lerp(momentum, grad, 1 - beta), beta)


def nesterov_input_and_momentum_into(out: Tensor, grad: Tensor, momentum: Tensor, beta: float | Tensor, nesterov: bool) -> Tensor:
    """The same into `out`; returns the new momentum lerp(M, g, 1−β) (a new fp32 tensor)."""
    grad = grad.float()
    new = torch.lerp(momentum, grad, 1 - beta)
    if nesterov:
        _into(out, torch.lerp, grad, new, beta)
    else:
        out.copy_(new)
    return new


def momentum_and_nesterov_input_(momentum: Tensor, out: Tensor, grad: Tensor, beta: float | Tensor, nesterov: bool) -> None:
    """In place M ← lerp(M, g, 1−β), and out ← the Nesterov input from it, in one pass: the same
    values as nesterov_input_into followed by momentum_update_ (commit="streaming" only: the
    momentum is written before the ranks agree)."""
    grad = grad.float()
    momentum.lerp_(grad, 1 - beta)
    if nesterov:
        _into(out, torch.lerp, grad, momentum, beta)
    else:
        out.copy_(momentum)


def momentum_update_(momentum: Tensor, grad: Tensor, beta: float | Tensor) -> None:
    """In place: M ← lerp(M, g, 1 − β), the lerp the Nesterov input used."""
    momentum.lerp_(grad.float(), 1 - beta)


def decay_and_step_(param: Tensor, update: Tensor, decay: Tensor, lr: Tensor) -> None:
    """In place, one pass: W ← decay·W − lr·U, in fp32."""
    param.copy_(param.float() * decay - update.float() * lr)


def lerp_step_(param: Tensor, returned: Tensor, weight: Tensor) -> None:
    """In place, one pass: W ← lerp(W, R, w) in fp32, torch.lerp's formula for w < 1/2."""
    param.copy_(param.float() + weight * (returned.float() - param.float()))


def decay_and_step_measured_(param: Tensor, update: Tensor, decay: Tensor, lr: Tensor, squares: Tensor) -> None:
    """decay_and_step_, and squares += Σ update² (fp32): compiled, one pass."""
    decay_and_step_(param, update, decay, lr)
    _add_squares(squares, update)


def lerp_step_measured_(param: Tensor, returned: Tensor, weight: Tensor, squares: Tensor) -> None:
    """lerp_step_, and squares += Σ R² (fp32): compiled, one pass."""
    lerp_step_(param, returned, weight)
    _add_squares(squares, returned)


def _add_squares(squares: Tensor, x: Tensor) -> None:
    x = x.float()
    squares.add_((x * x).sum())


def momenta_and_nesterov_inputs_(momenta: list[Tensor], outs: list[Tensor], grads: list[Tensor], beta: float | Tensor, nesterov: bool) -> None:
    """momentum_and_nesterov_input_ on each block of the lists (one compiled call for them all)."""
    for momentum, out, grad in zip(momenta, outs, grads):
        momentum_and_nesterov_input_(momentum, out, grad, beta, nesterov)


def nesterov_inputs_into(outs: list[Tensor], grads: list[Tensor], momenta: list[Tensor], beta: float | Tensor, nesterov: bool) -> None:
    """nesterov_input_into on each block of the lists."""
    for out, grad, momentum in zip(outs, grads, momenta):
        nesterov_input_into(out, grad, momentum, beta, nesterov)


def nesterov_inputs_and_momenta_into(outs: list[Tensor], grads: list[Tensor], momenta: list[Tensor], beta: float | Tensor,
                                     nesterov: bool) -> list[Tensor]:  # fmt: skip
    """nesterov_input_and_momentum_into on each block of the lists; returns the new momenta."""
    return [nesterov_input_and_momentum_into(out, grad, momentum, beta, nesterov) for out, grad, momentum in zip(outs, grads, momenta)]


def momentum_updates_(momenta: list[Tensor], grads: list[Tensor], beta: float | Tensor) -> None:
    """momentum_update_ on each block of the lists."""
    for momentum, grad in zip(momenta, grads):
        momentum_update_(momentum, grad, beta)


def decay_and_steps_(params: list[Tensor], updates: list[Tensor], decay: Tensor, lr: Tensor) -> None:
    for param, update in zip(params, updates):
        decay_and_step_(param, update, decay, lr)


def lerp_steps_(params: list[Tensor], returned: list[Tensor], weight: Tensor) -> None:
    for param, update in zip(params, returned):
        lerp_step_(param, update, weight)


def decay_and_steps_measured_(params: list[Tensor], updates: list[Tensor], decay: Tensor, lr: Tensor, squares: Tensor) -> None:
    for param, update in zip(params, updates):
        decay_and_step_measured_(param, update, decay, lr, squares)


def lerp_steps_measured_(params: list[Tensor], returned: list[Tensor], weight: Tensor, squares: Tensor) -> None:
    for param, update in zip(params, returned):
        lerp_step_measured_(param, update, weight, squares)


# One call of a torch.compile'd pass costs the host ~56 µs where an eager op costs ~2 (guards and
# wrappers; each further block of the same call ~8 µs: scripts/measure_compiled_call.py), and a
# step has a block per matrix on every rank: compiled passes take their blocks in lists, up to
# COMPILED_LIST per call. Dynamo compiles once per list length, so lists come in the lengths of
# CALL_SIZES, whose binary split of a round's blocks makes the fewest calls: five graphs per pass.
# Dynamo keeps its graphs, and its limit of 8 recompiles, per code object: each variant of a call
# (length, dtypes, Nesterov) gets a copy of the pass with a code object of its own
# (_compiled_copies), else a second dtype would pass the limit and run eagerly; β goes as a
# tensor, so that a momentum schedule compiles nothing after its first step.
CALL_SIZES = (16, 8, 4, 2, 1)
COMPILED_LIST = CALL_SIZES[0]


def call_chunks(n: int) -> list[slice]:
    """[0, n) cut into consecutive slices of CALL_SIZES lengths, as many of the longest as fit, then the next."""
    chunks, start = [], 0
    for size in CALL_SIZES:
        while n - start >= size:
            chunks.append(slice(start, start + size))
            start += size
    return chunks


def _size(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, Tensor) else 0


def _one_kernel_range(fn, args) -> torch.profiler.record_function:
    """A ``titan_muon/fused:<bytes>`` profiler range, <bytes> being what the one kernel `fn(*args)`
    compiles to moves: each tensor argument once, and once more the first where `fn` updates it
    in place (a name ending in ``_``) or the fp32 momentum it returns."""
    moved = sum(_size(a) for a in args)
    if fn.__name__.endswith("_"):
        moved += _size(args[0])
    elif fn is nesterov_input_and_momentum_into:
        moved += args[2].numel() * 4
    return torch.profiler.record_function(f"titan_muon/fused:{moved}")


def _marked_as_one_call(block_fn, lists: int):
    """The list form of `block_fn` on ``meta``: one ``titan_muon/compiled_call`` range for the
    call, a kernel's range per block inside it (inductor compiles a list to one kernel per block,
    launched by one call). On ``meta`` there is no compiler: this is how a trace of the step
    (scale_replay/step_trace.py) sees the passes a GPU runs, and what each call costs its host."""

    def marked(*args):
        results = []
        with torch.profiler.record_function("titan_muon/compiled_call"):
            for blocks in zip(*args[:lists]):
                block_args = (*blocks, *args[lists:])
                with _one_kernel_range(block_fn, block_args):
                    results.append(block_fn(*block_args))
        return results

    return marked


def _in_chunks(fn, lists: int):
    """fn called on call_chunks of its first `lists` arguments (lists of blocks); what the calls
    return (lists, one item per block), concatenated."""

    def chunked(*args):
        results = []
        for chunk in call_chunks(len(args[0])):
            results += fn(*(a[chunk] for a in args[:lists]), *args[lists:]) or []
        return results

    return chunked


def _with_own_code(fn):
    """A copy of `fn` whose code object is its own (dynamo's graph cache lives on the code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@functools.lru_cache(maxsize=64)
def _scalar_tensor(value: float, device: torch.device) -> Tensor:
    """A Python float (momentum β) as the 0-dim fp32 tensor a compiled pass takes instead: dynamo
    would compile a graph per value (a momentum warm-up: one per step), a tensor's value is no
    part of the graph. Never written: one per value and device serves every call."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _floats_as_tensors(args: tuple, device: torch.device) -> tuple:
    return tuple(_scalar_tensor(a, device) if isinstance(a, float) else a for a in args)


# (pass, length, Python scalars, dtypes) -> its compiled copy, shared by every optimizer in the
# process (several model parts per rank: each Muon has its own Elementwise)
_COMPILED_COPIES: dict[tuple, object] = {}


def _compiled_copies(fn, lists: int):
    """`fn` compiled, one copy per variant of a call: its length, the dtypes of its lists (their
    first blocks': a list mixing dtypes recompiles within its copy) and its non-float Python
    scalars (Nesterov; floats go as tensors: _scalar_tensor). Each copy then compiles once, and no
    variant can exhaust another's recompile limit."""

    def call(*args):
        scalars = _floats_as_tensors(args[lists:], args[0][0].device)
        constants = tuple(s for s in scalars if not isinstance(s, Tensor))
        key = (fn, len(args[0]), constants, *(blocks[0].dtype for blocks in args[:lists]))
        compiled = _COMPILED_COPIES.get(key)
        if compiled is None:
            compiled = _COMPILED_COPIES[key] = torch.compile(_with_own_code(fn), dynamic=True, fullgraph=True)
        return compiled(*args[:lists], *scalars)

    return call


class Elementwise:
    """The passes, compiled (``compiled=True``) or eager; compiled on ``meta``: eager, marked as
    the single kernels they compile to."""

    def __init__(self, compiled: bool, device_type: str = "cuda"):
        self.compiled = compiled
        if not compiled:
            over_lists = lambda fn, block_fn, lists: fn  # noqa: E731
        elif device_type == "meta":
            over_lists = lambda fn, block_fn, lists: _in_chunks(_marked_as_one_call(block_fn, lists), lists)  # noqa: E731
        else:
            over_lists = lambda fn, block_fn, lists: _in_chunks(_compiled_copies(fn, lists), lists)  # noqa: E731
        # Each takes lists of blocks (then the scalars): one compiled call per chunk of them.
        self.momenta_and_nesterov_inputs_ = over_lists(momenta_and_nesterov_inputs_, momentum_and_nesterov_input_, 3)
        self.nesterov_inputs_into = over_lists(nesterov_inputs_into, nesterov_input_into, 3)
        self.nesterov_inputs_and_momenta_into = over_lists(nesterov_inputs_and_momenta_into, nesterov_input_and_momentum_into, 3)
        self.momentum_updates_ = over_lists(momentum_updates_, momentum_update_, 2)
        self._decay_and_steps_ = over_lists(decay_and_steps_, decay_and_step_, 2)
        self._lerp_steps_ = over_lists(lerp_steps_, lerp_step_, 2)
        self._decay_and_steps_measured_ = over_lists(decay_and_steps_measured_, decay_and_step_measured_, 2)
        self._lerp_steps_measured_ = over_lists(lerp_steps_measured_, lerp_step_measured_, 2)

    def decay_and_step_(self, params: list[Tensor], returned: list[Tensor], lr: float, weight_decay: float,
                        update_sq: Tensor | None = None, scratch: Tensor | None = None) -> None:  # fmt: skip
        """W ← (1 − lr·wd)·W − lr·U for many blocks, from R = U·commit_scale(wd) as the owners
        return it: lerp(W, R, lr·wd) where the scale folds −1/wd in, else (1 − lr·wd)·W − lr·R.
        Eagerly one foreach lerp (a multiply and an add where W and R differ in dtype, which lerp
        refuses, or the decay is not folded), compiled one kernel per block, the blocks in lists
        (one call per chunk of CALL_SIZES); no temporaries.
        With `update_sq` (an fp32 scalar) it also adds ‖lr·U‖² of the blocks to it (muon/update_rms)
        through the fp32 scalar `scratch`: compiled in the same pass, eagerly one norm per block."""
        if not params:
            return
        squares = None
        if update_sq is not None:
            factor = (lr / commit_scale(weight_decay)) ** 2  # R = U·commit_scale(wd)
            if self.compiled:
                squares = scratch.zero_()
            else:
                for r in returned:
                    torch.linalg.vector_norm(r, dtype=torch.float32, out=scratch)
                    update_sq.addcmul_(scratch, scratch, value=factor)
        device = params[0].device
        folded = commit_scale(weight_decay) != 1.0
        # lr·wd in fp32, as the kernels use it: an fp32 tensor lr (0.0099999998) and the number it
        # holds (0.01) give the same weight (a product in float64 could round to another fp32 value)
        weight = _fp32(_fp32(lr) * _fp32(weight_decay))
        if not self.compiled and folded and all(p.dtype == r.dtype for p, r in zip(params, returned)):
            torch._foreach_lerp_(params, returned, weight)
            return
        # 0-dim fp32 factors: a Python float would be rounded to a bf16 parameter's dtype by the
        # foreach kernels (1 − 0.002 becomes 0.99609375, more than twice the decay).
        decay = torch.full((), 1 - weight, dtype=torch.float32, device=device)
        if not self.compiled:
            if weight != 0:
                torch._foreach_mul_(params, decay)
            torch._foreach_add_(params, returned, alpha=weight if folded else -lr)  # mixed dtypes: no converted copy
            return
        step = torch.full((), weight if folded else lr, dtype=torch.float32, device=device)
        factors = (step,) if folded else (decay, step)
        if squares is None:
            steps = self._lerp_steps_ if folded else self._decay_and_steps_
        else:
            steps = self._lerp_steps_measured_ if folded else self._decay_and_steps_measured_
            factors += (squares,)
        steps(params, returned, *factors)
        if squares is not None:
            update_sq.add_(squares, alpha=factor)
