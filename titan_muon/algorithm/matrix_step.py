"""One step's work on the Muon matrices: what travels, what owners compute, where updates go.

Between the gradient agreement and the commit, every rank set's exchange engine (exchange.py)
runs its rounds and calls back into a :class:`MatrixStep`, which holds everything the step's
matrix work needs:

* ``fill`` — what a piece carries to its owner: the Nesterov input g + μ(M' − g) made from this
  rank's momentum, written straight into the send buffer in the wire dtype; the raw gradient
  where the owners hold momentum (overlap, DeMo); zeros for a parameter without gradients;
* ``orthogonalize`` — what an owner computes for a round: the input of each batch (as it
  arrived; the owners' own Nesterov input; DeMo's average over the replicas), Newton–Schulz,
  the shape's scale;
* ``receive`` — each returned update, kept for the commit with the block it updates or, with
  ``streaming``, written into that block once its whole round has returned (``write_round``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_muon.algorithm.commit import StepWork, apply_updates, staged_state
from titan_muon.algorithm.orthogonalizer import Orthogonalizer
from titan_muon.algorithm.update import Elementwise, coalesce
from titan_muon.exchange.engine import ExchangeEngine, StepFailure
from titan_muon.exchange.params import MuonParam
from titan_muon.exchange.plan import Piece, Unit
from titan_muon.exchange.redistribute import Batch, local_piece
from titan_muon.exchange.verdict import Verdict
from titan_muon.timing import StepTimer, phase


@dataclass
class MatrixStep:
    params: list[MuonParam]  # the optimizer's Muon parameters, by MuonParam.index
    state: dict  # the optimizer's per-parameter state
    owner_blocks: dict  # (rank set, unit) -> whole-matrix momentum on its owner
    storage: object  # state.MomentumStorage
    comm_dtype: torch.dtype
    newton_schulz: Orthogonalizer
    elementwise: Elementwise
    replicas: object | None  # demo_step.Replicas with DeMo
    verdict: Verdict
    failure: StepFailure
    timer: StepTimer
    work: StepWork
    streaming: bool = False  # commit="streaming": weights written round by round
    momenta: dict[int, Tensor] = field(default_factory=dict)  # decoded low-precision momentum, once per parameter

    def run(self, engines: list[ExchangeEngine]) -> None:
        """Every rank set's rounds; last, the matrices this rank holds whole (a one-rank exchange)."""
        for s, engine in enumerate(engines):
            early = self.verdict.early[s]
            scales = early.scales if early is not None else {}
            self.work.held += engine.run(
                dtype=torch.float32 if engine.owners_hold_momentum else self.comm_dtype, return_dtype=self.comm_dtype,
                fill=lambda pairs, engine=engine: self.fill(engine, pairs),
                receive=lambda r, piece, update, engine=engine: self.receive(engine, piece, update),
                failure=self.failure, memory=self.work.memory,
                orthogonalize=lambda r, batches, s=s, engine=engine: self.orthogonalize(s, engine, r, batches, scales.get(r, {})),
                key_of=lambda u, engine=engine: self.ns_key(engine.units[u]),
                arrived=early.arrived if early is not None else None,
                settle=(lambda r, s=s, engine=engine: self.replicas.settle(s, r, engine)) if self.replicas is not None else None,
                returned=self.write_round if self.streaming else None,
            )  # fmt: skip

    def ns_key(self, unit: Unit) -> tuple[tuple[int, int], int]:
        """Matrices batch together when they have one shape and one param group's settings."""
        return (unit.shape, self.params[unit.param].group_index)

    # ------------------------------------------------------------------ shard side

    def fill(self, engine: ExchangeEngine, pairs: list[tuple[Piece, Tensor]]) -> None:
        nesterov: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}  # per parameter: (slot, gradient block, momentum block)
        for piece, out in pairs:
            entry = self.params[engine.units[piece.unit].param]
            p = entry.param
            if id(p) in self.verdict.skipped:
                out.zero_()
            elif engine.owners_hold_momentum:
                out.copy_(local_piece(entry.stack(p.grad), piece))
            else:
                if entry.index not in self.momenta:
                    self.momenta[entry.index] = entry.stack(self.storage.load(self.state[p]))
                    if self.storage.name != "fp32":  # a decoded copy, held for the rest of the exchange
                        self.work.memory.add(self.momenta[entry.index].numel() * 4)
                nesterov.setdefault(entry.index, []).append((out, local_piece(entry.stack(p.grad), piece), local_piece(self.momenta[entry.index], piece)))
        for index, blocks in nesterov.items():
            entry = self.params[index]
            beta, use_nesterov = entry.group["momentum"], entry.group["nesterov"]
            for out, grad, momentum in coalesce(blocks):  # adjacent blocks (an EP rank's experts): one pass per run
                if self.streaming and self.storage.name == "fp32":  # no rollback to protect: the commit's lerp is done here
                    self.elementwise.momentum_and_nesterov_input_(momentum, out, grad, beta, use_nesterov)
                    self.work.momentum_written.add(index)
                else:
                    self.elementwise.nesterov_input_into(out, grad, momentum, beta, use_nesterov)

    def receive(self, engine: ExchangeEngine, piece: Piece, update: Tensor) -> None:
        entry = self.params[engine.units[piece.unit].param]
        if id(entry.param) not in self.verdict.skipped:
            self.work.updates.append((entry, local_piece(entry.stack(entry.param), piece), update))

    def write_round(self, r: int) -> None:
        """commit="streaming": the returned round's updates go into the weights now, and go."""
        with phase("commit_round"):
            apply_updates(self.work.updates, self.elementwise)
        self.work.updates.clear()

    # ------------------------------------------------------------------ owner side

    def orthogonalize(self, s: int, engine: ExchangeEngine, r: int, batches: list[Batch], scales: dict[int, float]) -> dict[int, Tensor]:
        results: dict[int, Tensor] = {}
        memory = self.work.memory
        inputs = self._owner_inputs(s, engine, r, batches, scales)
        # Inputs made here (the owners' Nesterov input, DeMo's) live beside the arrivals until the round's NS is done.
        made = sum(m.numel() * m.element_size() for batch, m in zip(batches, inputs) if m is not batch.matrices)
        memory.add(made)
        for batch, matrices in zip(batches, inputs):
            for chunk in self.newton_schulz.chunks(batch.key, matrices):
                workspace = self.newton_schulz.workspace_bytes(batch.key, matrices[chunk])
                memory.add(workspace)
                out = self.newton_schulz(batch.key, matrices[chunk], self.timer, self.work)
                memory.free(workspace)
                memory.add(out.numel() * out.element_size() + 4)  # until the return buffer is packed; + the update's squared norm (metrics)
                results.update(zip(batch.units[chunk], out.unbind(0)))
        memory.free(made)
        return results

    def _owner_inputs(self, s: int, engine: ExchangeEngine, r: int, batches: list[Batch], scales: dict[int, float]) -> list[Tensor]:
        """What Newton–Schulz gets for each batch: DeMo's average of the replicas' compressed
        momentum, the owners' Nesterov input, or (momentum on the shards) the matrices as they arrived."""
        if self.replicas is not None:
            with phase("demo"):
                return self.replicas.round_inputs(s, r, engine, batches, self.owner_blocks, self.params, self.verdict.skipped,
                                                  self.storage, self.work)  # fmt: skip
        if engine.owners_hold_momentum:
            with phase("owner_momentum"):
                return [self._owner_nesterov(s, engine, b.units, b.matrices, scales) for b in batches]
        return [b.matrices for b in batches]

    def _owner_nesterov(self, s: int, engine: ExchangeEngine, units: list[int], gradients: Tensor, scales: dict[int, float]) -> Tensor:
        """With momentum on the owners: M' = μM + (1−μ)·c·g on whole matrices (staged for the
        commit) and the Nesterov input, rounded to the wire dtype as the shard-side path sends
        it. c undoes what happened to the gradient after it was sent during backward (gradient
        clipping), 1 if sent in step(). A matrix without gradients keeps its momentum."""
        out = torch.empty_like(gradients)
        for u, grad, slot in zip(units, gradients.unbind(0), out.unbind(0)):
            unit = engine.units[u]
            entry = self.params[unit.param]
            if id(entry.param) in self.verdict.skipped:
                slot.zero_()
                continue
            c = scales.get(unit.param, 1.0)
            if c != 1.0:
                grad.mul_(c)  # `gradients` is this batch's own assembled copy
            state = self.owner_blocks[(s, u)]
            momentum = self.storage.load(state)
            new = self.elementwise.nesterov_input_and_momentum_into(slot, grad, momentum, entry.group["momentum"], entry.group["nesterov"])
            first_row = unit.matrix * entry.param.shape[-2] + unit.row_start
            self.work.staged.append((state, staged_state(self.storage, state, new, unit.param, first_row, self.work.memory)))
        return out.to(self.comm_dtype).float() if self.comm_dtype != torch.float32 else out
