"""Momentum held whole by its owners, converted to and from the parameters' layout for checkpoints.

With ``overlap=True`` each sharded matrix's momentum lives on the rank that orthogonalizes
it, as plain (rows, cols) blocks. Checkpoints must not depend on that: DCP reshards state by
the parameters' placements. So ``state_dict()`` sends every block back to the ranks holding
the matching parameter pieces (a step's return trip, carrying state instead of updates), and
``load_state_dict()`` sends loaded pieces to the owners (the outbound trip). Both are
collectives over each rank set, like DCP itself, and walk the same tables as the step
(redistribute.py).

Each storage key is a matrix that follows the parameter's rows: as wide as the parameter
(fp32/bf16 buffers, fp8 codes) or with its own columns (fp8 exponents, one per block of
columns): the storage maps a piece's columns to the key's (``state_columns``), which under
tensor parallelism needs every column shard to start on a block boundary (checked when the
state is created).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from titan_muon.exchange.engine import ExchangeEngine, MemoryAccount, StepFailure
from titan_muon.exchange.plan import Piece
from titan_muon.exchange.redistribute import inbound_slots, local_piece, outbound_slots


def _column_map(storage, engine: ExchangeEngine, width_of):
    def columns(piece: Piece) -> tuple[int, int]:
        unit = engine.units[piece.unit]
        width = width_of(piece)
        return piece.cols if width == unit.cols else storage.state_columns(width, unit.cols, piece.cols)

    return columns


def blocks_to_shards(storage, params: Sequence, engine: ExchangeEngine, blocks: dict[int, dict[str, Tensor]], states: dict) -> None:
    """Fill `states[param]` (created by ``storage.create(param)``) from the owners' `blocks`:
    each round's return trip, carrying state instead of updates."""
    failure = StepFailure()
    for r, tables in enumerate(engine.tables):
        for key in storage.tensor_keys:
            columns = _column_map(storage, engine, lambda p: _state(states, params, engine, p, key).shape[-1])
            dtype = _state(states, params, engine, None, key).dtype
            back = engine.buffer(sum(engine.counts(r, columns)[1]), dtype, failure, f"allocating round {r}'s {key} blocks")
            for piece, slot in inbound_slots(tables, back, columns):
                lo, hi = columns(piece)
                slot.copy_(blocks[piece.unit][key][piece.rows[0] : piece.rows[1], lo:hi])
            received = engine.return_trip(r, back, failure, columns).wait()
            _raise(failure)
            for piece, slot in outbound_slots(tables, received, columns):
                entry = params[engine.units[piece.unit].param]
                local_piece(entry.stack(states[entry.param][key]), piece).copy_(slot)


def shards_to_blocks(storage, params: Sequence, engine: ExchangeEngine, states: dict) -> dict[int, dict[str, Tensor]]:
    """The owners' blocks, from `states[param]` laid out like the parameters: each round's
    outbound trip, carrying state instead of gradients."""
    failure = StepFailure()
    blocks: dict[int, dict[str, Tensor]] = {}
    for r, tables in enumerate(engine.tables):
        for u in tables.owned:
            unit = engine.units[u]
            blocks[u] = storage.create_block(unit.rows, unit.cols, engine.device)
            for key, value in blocks[u].items():
                if value.ndim == 0:  # a per-parameter counter: every rank has it
                    blocks[u][key] = states[params[unit.param].param][key].clone()
        for key in storage.tensor_keys:
            columns = _column_map(storage, engine, lambda p: _state(states, params, engine, p, key).shape[-1])

            def fill(pairs: list[tuple[Piece, Tensor]], key=key) -> None:
                for piece, slot in pairs:
                    entry = params[engine.units[piece.unit].param]
                    slot.copy_(local_piece(entry.stack(states[entry.param][key]), piece))

            dtype = _state(states, params, engine, None, key).dtype
            received = engine.launch(r, dtype, fill, failure, MemoryAccount(), columns).wait()
            _raise(failure)
            for piece, slot in inbound_slots(tables, received, columns):
                lo, hi = columns(piece)
                blocks[piece.unit][key][piece.rows[0] : piece.rows[1], lo:hi].copy_(slot)
    return blocks


def _raise(failure: StepFailure) -> None:
    if failure.error is not None:
        raise RuntimeError(f"titan_muon.Muon: converting owner momentum failed while {failure.where}") from failure.error


def _state(states: dict, params: Sequence, engine: ExchangeEngine, piece: Piece | None, key: str) -> Tensor:
    """The state tensor `key` of the parameter a piece belongs to (any parameter of the rank set for None)."""
    index = engine.units[piece.unit].param if piece is not None else engine.units[0].param
    return states[params[index].param][key]
