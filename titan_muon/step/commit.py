"""The end of a step: new state staged before the ranks agree, then written without allocating.

The step writes nothing until every rank has agreed that everything before succeeded. What
the commit would allocate is therefore computed first (:func:`stage_momentum`): new bf16 or
fp8 momentum is encoded into fresh tensors, low-precision gradients get their fp32 copies.
The commit (:func:`commit`) then only swaps those tensors in and updates in place — momentum
lerp, weight decay, the update, and the fused AdamW kernel — so an out-of-memory error on
one rank cannot leave it half-committed while the others have finished. torch's "foreach"
and "for-loop" AdamW kernels allocate temporaries; with them that guarantee does not cover
the AdamW groups (docs/reliability.md).

With ``commit="streaming"`` the weights of each round are written as its updates return
(:func:`apply_updates`), so no rank holds every update at once, and fp32 momentum on the
shards is updated by the pass that packs the Nesterov input (one read of M and g instead of
two); other momentum and AdamW still wait for the agreement. A failure after the first write cannot be undone: it is reported on
every rank as a partially applied step and the optimizer refuses to step again until a
checkpoint is loaded (:func:`refuse_after_partial_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from titan_muon.algorithm.update import Elementwise, coalesce
from titan_muon.base.dtensor import local_shard
from titan_muon.exchange.engine import MemoryAccount, StepFailure


@dataclass
class StepWork:
    """What the exchange leaves for the commit."""

    updates: list[tuple[object, Tensor, Tensor]] = field(default_factory=list)  # (MuonParam, local view, update)
    staged: list[tuple[dict, dict]] = field(default_factory=list)  # (state, its new tensors): swapped in at the commit
    grads32: dict[int, Tensor] = field(default_factory=dict)  # MuonParam index -> fp32 copy of a low-precision gradient
    momentum_written: set[int] = field(default_factory=set)  # MuonParam indexes whose fp32 momentum the packing updated
    held: list = field(default_factory=list)  # return buffers the updates view: alive until the commit
    update_sq: Tensor | None = None  # device scalar: the sum of squared lr-scaled updates (the optimizer makes it)
    update_numel: int = 0
    ns_flops: int = 0
    memory: MemoryAccount = field(default_factory=MemoryAccount)
    scratch: Tensor | None = None  # an fp32 scalar beside update_sq, for the commit's pass to sum into

    def __post_init__(self):
        if self.update_sq is not None:  # alive through the step, for the metrics
            self.scratch = torch.zeros_like(self.update_sq)
            self.memory.add(2 * self.update_sq.numel() * self.update_sq.element_size())


def staged_state(storage, state: dict, momentum: Tensor, stream: int, first_row: int | None, memory: MemoryAccount) -> dict:
    """`state`'s tensors after storing `momentum` (fp32), computed without touching `state`."""
    if storage.name == "fp32" and not isinstance(state["momentum_buffer"], DTensor):
        memory.add(momentum.numel() * 4)
        return {"momentum_buffer": momentum}
    staged = {key: _copy(value) for key, value in state.items()}
    storage.store(staged, momentum, stream=stream, first_row=first_row)
    memory.add(sum(local_shard(v).numel() * v.element_size() for v in staged.values()))
    return staged


def _copy(value):
    """A copy of a state tensor; a DTensor's local shard is copied and wrapped again, as DTensor's
    own clone would (without its sharding propagation, which a meta mesh cannot run)."""
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().clone(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())  # fmt: skip
    return value.clone()


def stage_momentum(storage, entries, state: dict, work: StepWork, failure: StepFailure) -> None:
    """New momentum M' = μM + (1−μ)g of the sharded-momentum parameters `entries`: staged tensors
    for bf16/fp8 storage; fp32 momentum is updated in place by the commit, from fp32 gradients
    (copied to fp32 here if they are not). Skipped after an earlier failure; a failure here is
    recorded in `failure`, to be settled on every rank."""
    if failure.error is not None:
        return
    try:
        _stage(storage, entries, state, work)
    except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
        failure.record(error, "staging the new momentum")


def _stage(storage, entries, state: dict, work: StepWork) -> None:
    for entry in entries:
        grad = local_shard(entry.param.grad)
        if storage.name == "fp32":
            if grad.dtype != torch.float32:
                work.grads32[entry.index] = grad.float()
                work.memory.add(grad.numel() * 4)
            continue
        momentum = storage.load(state[entry.param])
        momentum.lerp_(grad.float(), 1 - entry.group["momentum"])
        work.staged.append((state[entry.param], staged_state(storage, state[entry.param], momentum, entry.index, None, work.memory)))


def commit(storage, entries, owner_entries, state: dict, work: StepWork, elementwise: Elementwise) -> None:
    """Momentum (staged, or fp32 in place for `entries`), then the parameters; allocates nothing
    but the 0-dim decay factors. `owner_entries`, whose momentum the owners staged, count the
    store in their "step" (as their owners' blocks do)."""
    for target, staged in work.staged:
        target.update(staged)
    for entry in owner_entries:
        if "step" in state[entry.param]:
            state[entry.param]["step"] += 1
    if storage.name == "fp32":
        per_beta: dict[float, tuple[list[Tensor], list[Tensor]]] = {}  # one list pass per momentum β
        for entry in entries:
            if entry.index in work.momentum_written:
                continue
            momenta, grads = per_beta.setdefault(entry.group["momentum"], ([], []))
            momenta.append(local_shard(state[entry.param]["momentum_buffer"]))
            grads.append(work.grads32.get(entry.index, local_shard(entry.param.grad)))
        for beta, (momenta, grads) in per_beta.items():
            elementwise.momentum_updates_(momenta, grads, beta)
    apply_updates(work.updates, elementwise, work)


def apply_updates(updates: list[tuple[object, Tensor, Tensor]], elementwise: Elementwise, work: StepWork) -> None:
    """W ← (1 − lr·wd)·W − lr·update on each (MuonParam, local block, update), one fused pass per
    param group and dtype: at the commit, or as each round returns with ``commit="streaming"``.
    Where the step measures it (work.update_sq), the same pass adds ‖lr·U‖² of the blocks to it
    (muon/update_rms: over the blocks this rank holds)."""
    by_group: dict[tuple, tuple[dict, list[Tensor], list[Tensor]]] = {}
    for entry, target, update in updates:
        _, targets, group_updates = by_group.setdefault((entry.group_index, target.dtype), (entry.group, [], []))
        targets.append(target)
        group_updates.append(update)
    for group, targets, group_updates in by_group.values():
        targets, group_updates = zip(*coalesce(list(zip(targets, group_updates))))  # adjacent blocks: one pass per run
        lr = float(group["lr"])  # a device lr: one host read
        elementwise.decay_and_step_(list(targets), list(group_updates), lr, group["weight_decay"], work.update_sq, work.scratch)
        if work.update_sq is not None:
            work.update_numel += sum(t.numel() for t in targets)


def adamw_step_device(p: Tensor, implementation: str) -> torch.device:
    """Where AdamW's step counter lives, as torch.optim.AdamW keeps it: the fused kernel reads
    it on the device; the others read it on the host each step, which on a device would sync."""
    return p.device if implementation == "fused" else torch.device("cpu")


def new_adamw_state(p: Tensor, implementation: str) -> dict:
    step = torch.tensor(0.0, dtype=torch.float32, device=adamw_step_device(p, implementation))
    return {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def adamw_step(param_groups: list[dict], state: dict, implementation: str) -> None:
    """torch's AdamW kernel on the local shards of the AdamW groups' parameters."""
    for group in param_groups:
        if group["use_muon"]:
            continue
        live = [p for p in group["params"] if p.grad is not None]
        if not live:
            continue
        states = [state[p] for p in live]
        beta1, beta2 = group["betas"]
        adamw_functional(
            [local_shard(p) for p in live], [local_shard(p.grad) for p in live],
            [local_shard(s["exp_avg"]) for s in states], [local_shard(s["exp_avg_sq"]) for s in states], [],
            [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            foreach=implementation == "foreach", fused=implementation == "fused",
        )  # fmt: skip


def refuse_after_partial_step(partially_applied: bool) -> None:
    if partially_applied:
        raise RuntimeError(
            "titan_muon.Muon: an earlier streaming step (commit='streaming') failed after some of its updates were "
            "written, so the parameters are partially updated. Load a checkpoint (load_state_dict) before stepping "
            "again, or use commit='atomic', which writes nothing until every rank has succeeded."
        )
