"""Muon's state_dict and load_state_dict: checks before anything changes, state kept as saved.

torch's ``Optimizer.load_state_dict`` (which DCP's ``set_state_dict`` also reaches) casts
floating-point state to its parameter's dtype: that would make the fp32 momentum of bf16
parameters bf16 and fp8 codes floats. Muon's state passes through it wrapped and is only moved
to the parameter's device. With momentum on the owners (overlap), the owners' whole-matrix
blocks are converted to and from the parameters' layout (owner_state.py), so checkpoints do
not depend on who owned what.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_muon.step.commit import adamw_step_device, new_adamw_state
from titan_muon.demo.sign import ERROR_KEY
from titan_muon.demo.step import replica_keys
from titan_muon.exchange.transport import uncounted
from titan_muon.settings import GROUP_KEYS
from titan_muon.state.owner_held import blocks_to_shards, shards_to_blocks


@dataclass
class _PassedThrough:
    """State that torch's Optimizer.load_state_dict hands over as it is (it casts only tensors)."""

    value: dict


def create_state(opt) -> None:
    """Create every parameter's state at once, identically on every rank (DCP needs equal keys
    before the first save): AdamW's moments, Muon momentum on this rank's blocks or, where the
    owners hold it, placeholders here and whole-matrix blocks on the owners."""
    for group in opt.param_groups:
        if not group["use_muon"]:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p].update(new_adamw_state(p, opt.adamw_implementation))
                    if opt.replicas is not None:  # DeMo's error feedback of a compressed AdamW gradient
                        opt.state[p].update(opt.replicas.new_adamw_state(p))
    for entry in opt.muon_params:
        state = opt.state[entry.param]
        if entry.momentum_on_owner:
            for key, value in opt.storage.placeholders(opt.device).items():
                state.setdefault(key, value)
        elif not state:
            state.update(opt.storage.create(entry.param))
    for s, engine in enumerate(opt.engines):
        if engine.owners_hold_momentum:
            for u in engine.owned_units():
                if (s, u) not in opt.owner_blocks:
                    opt.owner_blocks[(s, u)] = opt.storage.create_block(engine.units[u].rows, engine.units[u].cols, opt.device)


def state_dict(opt, state_dict: dict) -> dict:
    """`state_dict` (torch's, of `opt`) with the owners' momentum laid out like the parameters;
    with DeMo, each replica's as its slice of a tensor over the replicas (Replicas.stacked), and so
    is each replica's error feedback of its sign-compressed AdamW gradients."""
    index_of = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    if opt.replicas is not None:
        for p in _adamw_with_error(opt):
            saved = state_dict["state"][index_of[id(p)]]  # torch's dict is the optimizer's own: replaced, not changed
            state_dict["state"][index_of[id(p)]] = {**saved, ERROR_KEY: opt.replicas.stacked(opt.state[p][ERROR_KEY], p)}
    states = owner_momentum_like_params(opt)
    if states is None:
        return state_dict
    held = list(states)
    if opt.replicas is not None:  # a replica-identical key (DeMo's shared momentum) is saved once, like the weights
        for p in held:
            for key in replica_keys(opt.storage):
                states[p][key] = opt.replicas.stacked(states[p][key], p)
    for p in held:
        state_dict["state"][index_of[id(p)]] = states[p]
    return state_dict


def owner_momentum_like_params(opt) -> dict | None:
    """The owners' momentum as state laid out like each parameter (``storage.create``'s
    layout, this replica's own with DeMo), by parameter; None before the first step (zeros
    for a parameter added since). A collective over every rank set: the return trip of the
    step, carrying state."""
    held = [e for e in opt.muon_params if e.momentum_on_owner]
    if not opt.owner_momentum or not any(opt.state.get(e.param) for e in held):
        return None
    states = {}
    for e in held:
        states[e.param] = opt.storage.create(e.param)
        for key, value in states[e.param].items():
            if value.ndim == 0 and opt.state.get(e.param):  # a per-parameter counter: every rank has it
                states[e.param][key] = opt.state[e.param][key].clone()
    for s, engine in enumerate(opt.engines):
        if engine.owners_hold_momentum:
            blocks = {u: block for (rank_set, u), block in opt.owner_blocks.items() if rank_set == s}
            with uncounted(engine.outbound, engine.back):
                blocks_to_shards(opt.storage, opt.muon_params, engine, blocks, states)
    return states


def momentum_back_to_owners(opt, states: dict | None) -> None:
    """After a new plan (``add_param_group``): hand each owner of the new plan the momentum of
    its matrices from `states` (:func:`owner_momentum_like_params` under the old plan).

    The owners' blocks are keyed by the plan's units, and a new group shifts the units, the
    rounds and who owns what: blocks kept under their old keys would feed one matrix's momentum
    to another. Parameters without saved state (the new group's) start from zero momentum, as
    their first step would create it. A collective over every rank set."""
    if states is None or not opt.owner_momentum:
        return
    sharded = [e for e in opt.muon_params if e.momentum_on_owner]
    full = {e.param: states[e.param] if e.param in states else opt.storage.create(e.param) for e in sharded}
    _send_to_owners(opt, full)
    for e in sharded:
        if opt.state.get(e.param):  # the others get theirs in the first step (create_state)
            placeholders = opt.storage.placeholders(opt.device)
            opt.state[e.param].update({key: placeholders[key] for key in opt.storage.tensor_keys})


def load_state_dict(opt, state_dict: dict, torch_load) -> None:
    """Check `state_dict` against `opt`'s groups, load it with `torch_load` (torch's loader)
    without casting Muon's state, and move owner momentum to the owners."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"titan_muon.Muon: the checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(opt.param_groups)}; the optimizer configuration changed since it was saved"
        )
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if saved.get("use_muon", True) != group["use_muon"]:
            raise ValueError(
                f"titan_muon.Muon: param group {gi} was saved with use_muon={saved.get('use_muon', True)} "
                f"but is now use_muon={group['use_muon']}"
            )
        for index, pi in zip(saved["params"], range(len(group["params"]))):
            keys = set(state_dict["state"].get(index, {}))
            p = group["params"][pi]
            expected = set(opt.storage.keys) if group["use_muon"] else {"step", "exp_avg", "exp_avg_sq", *_extra_adamw_keys(opt, p)}
            if keys and keys != expected:
                raise ValueError(
                    f"titan_muon.Muon: saved state of {opt.param_name(gi, pi)!r} has keys {sorted(keys)}, "
                    f"expected {sorted(expected)} ({'Muon' if group['use_muon'] else 'AdamW'}); "
                    "was the checkpoint written with another optimizer or parameter split?"
                )
    muon_indices = {i for saved, group in zip(saved_groups, opt.param_groups) if group["use_muon"] for i in saved["params"]}
    state = {i: _PassedThrough(value) if i in muon_indices else value for i, value in state_dict["state"].items()}
    errors = {}  # DeMo's per-replica error feedback of AdamW gradients: kept out of torch's cast to the parameter dtype
    for saved, group in zip(saved_groups, opt.param_groups):
        for index, p in zip(saved["params"], group["params"]):
            if not group["use_muon"] and ERROR_KEY in state.get(index, {}):
                state[index] = dict(state[index])
                errors[p] = state[index].pop(ERROR_KEY)
    torch_load({**state_dict, "state": state})
    for p, stacked in errors.items():
        own = opt.replicas.own_slice(stacked, p, opt.param_name(*_position(opt, p)))
        opt.state[p][ERROR_KEY] = own.to(device=p.device, dtype=torch.float32)
    tensor_keys = opt.storage.tensor_keys  # the rest are counters, kept on the host
    for group, saved in zip(opt.param_groups, saved_groups):
        for key in set(group) - set(saved) - set(GROUP_KEYS):  # torch's loader adds its own (differentiable)
            del group[key]
        for key, value in opt.defaults.items():  # checkpoints written before a setting existed
            if key in GROUP_KEYS:
                group.setdefault(key, value)
        if group["use_muon"]:  # a Muon group's "eps" is its ns_eps (before wave 4 it held AdamW's, unused)
            group["eps"] = group["ns_eps"]
        for p in group["params"]:
            loaded = opt.state.get(p)
            if isinstance(loaded, _PassedThrough):
                opt.state[p] = {key: value.to(p.device if key in tensor_keys else "cpu") for key, value in loaded.value.items()}
            elif loaded and not group["use_muon"]:  # saved under another adamw_implementation perhaps
                loaded["step"] = loaded["step"].to(dtype=torch.float32, device=adamw_step_device(p, opt.adamw_implementation))
    for entry in opt.muon_params:
        entry.group = opt.param_groups[entry.group_index]
    if opt.owner_momentum:
        _move_loaded_momentum_to_owners(opt)


def _move_loaded_momentum_to_owners(opt) -> None:
    sharded = [e for e in opt.muon_params if e.momentum_on_owner]
    tensors = opt.storage.tensor_keys
    loaded = [all(k in opt.state[e.param] and opt.state[e.param][k].ndim > 0 for k in tensors) for e in sharded]
    if not any(loaded):
        return
    if not all(loaded):
        missing = [e.name for e, ok in zip(sharded, loaded) if not ok]
        raise ValueError(f"titan_muon.Muon: the checkpoint has Muon state for some parameters but not for {missing}")
    states = {e.param: dict(opt.state[e.param]) for e in sharded}
    if opt.replicas is not None:  # every replica takes its own slice (checked against the replica count first)
        for e in sharded:
            states[e.param].update({k: opt.replicas.own_slice(states[e.param][k], e.param, e.name) for k in replica_keys(opt.storage)})
    _send_to_owners(opt, states)
    for e in sharded:
        placeholders = opt.storage.placeholders(opt.device)
        opt.state[e.param].update({key: placeholders[key] for key in tensors})


def _send_to_owners(opt, states: dict) -> None:
    """Replace the owners' blocks by `states` (every owner-held parameter's, laid out like it)."""
    opt.owner_blocks = {}
    for s, engine in enumerate(opt.engines):
        if engine.owners_hold_momentum:
            with uncounted(engine.outbound, engine.back):
                blocks = shards_to_blocks(opt.storage, opt.muon_params, engine, states)
            for u, block in blocks.items():
                opt.owner_blocks[(s, u)] = block


def _adamw_with_error(opt) -> list:
    """AdamW parameters that hold DeMo's error feedback (sign-compressed gradients)."""
    return [p for g in opt.param_groups if not g["use_muon"] for p in g["params"] if ERROR_KEY in opt.state.get(p, {})]


def _extra_adamw_keys(opt, p) -> tuple[str, ...]:
    return (ERROR_KEY,) if opt.replicas is not None and opt.replicas.compresses(p) else ()


def _position(opt, p) -> tuple[int, int]:
    for gi, group in enumerate(opt.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return gi, pi
    raise KeyError("parameter not in the optimizer")
