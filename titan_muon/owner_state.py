"""Momentum held whole by its owners, converted to and from the parameters' layout for checkpoints.

With ``overlap=True`` each sharded matrix's momentum lives on the rank that orthogonalizes
it, as plain (rows, cols) blocks. Checkpoints must not depend on that: DCP reshards state by
the parameters' placements. So ``state_dict()`` sends every block back to the ranks holding
the matching parameter pieces (the return trip of a step, carrying state instead of
updates), and ``load_state_dict()`` sends loaded pieces to the owners (the outbound trip).
Both are collectives over the optimizer's process group, like DCP itself.

Each storage key is a (rows, width) matrix that follows the parameter's rows: width is the
parameter's column count (fp32/bf16 buffers, fp8 codes) or another count (fp8 exponents, one
per column block). Keys of another width need whole rows on every rank (no column sharding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from titan_muon.plan import BucketSchedule, Piece, Plan
from titan_muon.redistribute import pack
from titan_muon.transport import Transport


def _piece_widths(schedule: BucketSchedule, plan: Plan, params: Sequence, states: dict, blocks: dict, key: str) -> tuple[dict, dict]:
    """Column ranges of state `key` that each outbound piece (in the parameter-shaped state) and
    each inbound piece (in the owner's block) covers, keyed by id(piece)."""
    outbound = {}
    for piece in schedule.outbound:
        unit = plan.units[piece.unit]
        outbound[id(piece)] = _width(piece, unit.cols, _key_cols(states, params, unit.param, key))
    inbound = {id(piece): _width(piece, plan.units[piece.unit].cols, blocks[piece.unit][key].shape[1]) for piece in schedule.inbound}
    return outbound, inbound


def _width(piece: Piece, unit_cols: int, key_cols: int) -> tuple[int, int]:
    """The columns of a key's matrix that a piece covers."""
    if key_cols == unit_cols:
        return piece.cols
    if piece.cols != (0, unit_cols):
        raise NotImplementedError("momentum state with its own column blocks needs whole rows on every rank")
    return (0, key_cols)


def _counts(pieces: Sequence[Piece], world: int, widths: dict[int, tuple[int, int]]) -> tuple[int, ...]:
    counts = [0] * world
    for piece in pieces:
        lo, hi = widths[id(piece)]
        counts[piece.peer] += (piece.rows[1] - piece.rows[0]) * (hi - lo)
    return tuple(counts)


def blocks_to_shards(
    storage,
    params: Sequence,
    plan: Plan,
    schedules: Sequence[BucketSchedule],
    transport: Transport,
    blocks: dict[int, dict[str, Tensor]],
    states: dict,
) -> None:
    """Fill `states[param]` (created by ``storage.create(param)``) from the owners' `blocks`."""
    world = transport.world_size
    for schedule in schedules:
        for key in storage.keys:
            example = next(iter(states.values()))[key]
            if example.ndim == 0:
                continue
            outbound_widths, inbound_widths = _piece_widths(schedule, plan, params, states, blocks, key)
            parts = [
                blocks[p.unit][key][p.rows[0] : p.rows[1], slice(*inbound_widths[id(p)])] for p in schedule.inbound
            ]
            dtype = blocks[schedule.owned[0]][key].dtype if schedule.owned else example.dtype
            back = pack(parts, dtype, transport.device)
            received = transport.all_to_all(
                back, _counts(schedule.inbound, world, inbound_widths), _counts(schedule.outbound, world, outbound_widths)
            ).wait()
            offset = 0
            for piece in schedule.outbound:
                entry = params[plan.units[piece.unit].param]
                target = entry.stack(states[entry.param][key])[piece.local[0], piece.local[1] : piece.local[2]]
                target.copy_(received[offset : offset + target.numel()].view(target.shape))
                offset += target.numel()


def shards_to_blocks(
    storage,
    params: Sequence,
    plan: Plan,
    schedules: Sequence[BucketSchedule],
    transport: Transport,
    states: dict,
    device: torch.device,
) -> dict[int, dict[str, Tensor]]:
    """The owners' blocks, from `states[param]` laid out like the parameters."""
    world = transport.world_size
    blocks: dict[int, dict[str, Tensor]] = {}
    for schedule in schedules:
        for u in schedule.owned:
            unit = plan.units[u]
            blocks[u] = storage.create_block(unit.rows, unit.cols, device)
        for key in storage.keys:
            example = next(iter(states.values()))[key]
            if example.ndim == 0:
                for u in schedule.owned:  # a per-parameter counter: every rank has it
                    blocks[u][key] = states[params[plan.units[u].param].param][key].clone()
                continue
            outbound_widths, inbound_widths = _piece_widths(schedule, plan, params, states, blocks, key)
            parts = []
            for piece in schedule.outbound:
                entry = params[plan.units[piece.unit].param]
                parts.append(entry.stack(states[entry.param][key])[piece.local[0], piece.local[1] : piece.local[2]])
            send = pack(parts, example.dtype, device)
            received = transport.all_to_all(
                send, _counts(schedule.outbound, world, outbound_widths), _counts(schedule.inbound, world, inbound_widths)
            ).wait()
            offset = 0
            for piece in schedule.inbound:
                lo, hi = inbound_widths[id(piece)]
                target = blocks[piece.unit][key][piece.rows[0] : piece.rows[1], lo:hi]
                target.copy_(received[offset : offset + target.numel()].view(target.shape))
                offset += target.numel()
    return blocks


def _key_cols(states: dict, params: Sequence, param_index: int, key: str) -> int:
    return states[params[param_index].param][key].shape[-1]
