"""muon/peak_transient_bytes against what is really alive (tests/live_bytes.py): the optimizer's
account must bound the storages the step allocates, backward's early sends included, and
overestimate them only through its model of Newton–Schulz's workspace."""

from pathlib import Path

from common import grads_for, make_params
from distributed import run_distributed
from live_bytes import LiveBytes
from sharded_fixtures import token_batches, next_token_loss, fsdp_model
from torch import nn

from titan_muon import Muon, build_param_groups

SHAPES = {"a": (300, 640), "b": (630, 640), "c": (640, 300), "d": (30, 64)}


def _model_slack(opt) -> float:
    """What the account may overestimate: Newton-Schulz's workspace is charged to the byte but
    for one norm scalar per matrix (newton_schulz.workspace_bytes, tests/test_newton_schulz.py);
    4 bytes per unit of the largest round an owner orthogonalizes."""
    return 4 * max(len(t.owned) for e in opt.engines for t in e.tables)


def _verdict_bytes(params) -> int:
    """What the account may miss: a streaming step reserves its memory before the gradient verdict,
    whose small per-parameter status tensors (float64 norms and flags, their concatenation and its
    all-reduce: at most 8 x 8 bytes per parameter) are then alive beside it and not charged."""
    return 64 * len(params)


def _kept(opt) -> int:
    """A reservation kept from an earlier step (on CPU by default: reservation.py) is alive through
    the step and counted in its account, but was allocated before the step's LiveBytes began."""
    return int(opt.last_step_metrics["muon/kept_reservation_bytes"])


def test_peak_transient_bytes_bound_what_is_really_alive():
    for momentum_dtype in ("fp32", "fp8"):
        for memory in (None, 0.5):  # one round, then four
            params = make_params(shapes=SHAPES)
            tensors = {n: nn.Parameter(p) for n, p in params.items()}
            opt = Muon(list(tensors.values()), lr=0.01, momentum_dtype=momentum_dtype, exchange_memory_mb=memory)
            for s in range(2):  # the second step, with state in place
                for n, g in grads_for(s, params).items():
                    tensors[n].grad = g
                with LiveBytes() as live:
                    opt.step()
            account = opt.last_step_metrics["muon/peak_transient_bytes"]
            alive = live.peak + _kept(opt)
            assert alive - _verdict_bytes(tensors) <= account <= alive + _model_slack(opt), (momentum_dtype, memory, live.peak, account)


def _overlapped(rank, world):
    import titan_muon

    package = str(Path(titan_muon.__file__).parent)
    model = fsdp_model(world)
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, overlap=True, exchange_memory_mb=0.002)
    for s in range(2):
        # backward's sends to the owners stay alive into the step; what backward allocates
        # itself (activation gradients, FSDP's buffers) is not the optimizer's: only storages
        # allocated while titan_muon's code runs are counted
        with LiveBytes(only_from=package) as live:
            next_token_loss(model, token_batches(s).chunk(world)[rank]).backward()
            opt.step()
        opt.zero_grad()
    return {"account": opt.last_step_metrics["muon/peak_transient_bytes"], "slack": _model_slack(opt), "live": live.peak,
            "late": live.released_elsewhere}


def test_peak_transient_bytes_with_overlap_count_the_buffers_sent_in_backward():
    for result in run_distributed(_overlapped, 2):
        # A storage gloo's worker thread released after the step had moved on may raise the
        # peak by its own size at most ("late", usually 0): the account may be below that much.
        assert result["live"] - result["late"] <= result["account"] <= result["live"] + result["slack"], result


def test_newton_schulz_in_chunks_changes_no_weight_and_the_account_still_holds(monkeypatch):
    """An owner's batch of equal matrices runs through NS in chunks within NS_CHUNK_BYTES: forced
    down to one matrix per chunk, the weights are bit for bit the whole batch's (on CPU a batch
    runs one matrix at a time either way) and the account still bounds what is alive — which
    now includes the return buffer beside the results it is cut from (on CPU that moment is the
    peak, whole batch or chunks; where the peak falls is tests/test_meta_device.py's)."""
    import torch

    from titan_muon.algorithm import orthogonalizer

    shapes = {f"w{i}": (300, 640) for i in range(4)} | {"d": (30, 64)}

    def run():
        params = make_params(shapes=shapes)
        tensors = {n: nn.Parameter(p) for n, p in params.items()}
        opt = Muon(list(tensors.values()), lr=0.01)
        for s in range(2):
            for n, g in grads_for(s, params).items():
                tensors[n].grad = g
            with LiveBytes() as live:
                opt.step()
        return tensors, opt.last_step_metrics["muon/peak_transient_bytes"], live.peak + _kept(opt) - _verdict_bytes(tensors), _model_slack(opt)

    whole, account, live, slack = run()
    assert live <= account <= live + slack
    monkeypatch.setattr(orthogonalizer, "NS_CHUNK_BYTES", 1)
    chunked, account, live, slack = run()
    assert all(torch.equal(whole[n], chunked[n]) for n in shapes)
    assert live <= account <= live + slack
