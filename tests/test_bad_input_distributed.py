"""Bad input on one rank: every rank raises the same clear error (or skips alike); nobody hangs."""

import torch
import torch.distributed as dist
from distributed import run_distributed
from sharded_fixtures import SHAPES, distributed_params, muon_for, set_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return (type(e).__name__, str(e))


def _bad_inputs(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    placements = [Shard(0)]
    outcomes = {}

    def fresh(**overrides):
        module = distributed_params(mesh, placements)
        opt = muon_for(module, **overrides)
        set_grads(module, 0, mesh, placements)
        opt.step()  # one healthy step first
        set_grads(module, 1, mesh, placements)
        return module, opt

    def snapshot(module, opt):
        return [p.to_local().clone() for p in module.parameters()], [
            v.to_local().clone() for s in opt.state.values() for k, v in s.items() if k != "step"
        ]

    def unchanged(before, module, opt):
        after = snapshot(module, opt)
        return all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))

    # A NaN in rank 1's rows of a Muon matrix.
    module, opt = fresh()
    before = snapshot(module, opt)
    if rank == 1:
        module.b.grad.to_local()[0, 0] = float("nan")
    outcomes["nan"] = _outcome(opt.step) + (unchanged(before, module, opt),)

    # The same with nonfinite_grads="skip": every rank skips, nothing changes.
    module, opt = fresh(nonfinite_grads="skip")
    before = snapshot(module, opt)
    if rank == 1:
        module.emb.grad.to_local()[0, 0] = float("inf")
    outcomes["skip"] = _outcome(opt.step) + (unchanged(before, module, opt), opt.last_step_metrics["muon/skipped_steps"])

    # A gradient missing on rank 0 only.
    module, opt = fresh()
    before = snapshot(module, opt)
    if rank == 0:
        module.a.grad = None
    outcomes["missing"] = _outcome(opt.step) + (unchanged(before, module, opt),)

    # A gradient missing everywhere: that parameter is skipped, the others step.
    module, opt = fresh()
    module.a.grad = None
    a_before = module.a.to_local().clone()
    outcomes["missing_everywhere"] = _outcome(opt.step) + (torch.equal(module.a.to_local(), a_before),)

    # Rank 1 built its model with another shape: the plan fingerprint differs.
    shapes = dict(SHAPES, e=(48, 49) if rank == 1 else (48, 48))
    outcomes["plan"] = _outcome(lambda: muon_for(distributed_params(mesh, placements, shapes)))

    # A placement that gives no rank a block of the matrix (a pending sum) is refused by name.
    module = distributed_params(mesh, placements)
    module.c = torch.nn.Parameter(DTensor.from_local(torch.randn(3, 256), mesh, [Partial()], run_check=False))
    outcomes["placement"] = _outcome(lambda: muon_for(module))

    # The process group still works after all of this.
    alive = torch.ones(1)
    dist.all_reduce(alive)
    outcomes["alive"] = alive.item()
    return outcomes


def test_bad_input_on_one_rank_raises_everywhere_without_hanging():
    results = run_distributed(_bad_inputs, 3, timeout=180)
    for case, kind, needle in [
        ("nan", "FloatingPointError", "non-finite (NaN/Inf) gradients in ['b']"),
        ("missing", "RuntimeError", "gradients of ['a'] exist on some ranks but not on others"),
        ("plan", "RuntimeError", "the Muon ownership plan differs between ranks"),
        ("placement", "ValueError", "parameter 'c': placement P(sum) is not supported"),
    ]:
        for rank, outcome in enumerate(results):
            assert outcome[case][0] == kind and needle in outcome[case][1], (case, rank, outcome[case])
    for outcome in results:
        assert outcome["nan"][2] and outcome["missing"][2], "state or parameters changed before the error"
        assert outcome["skip"][:3] == ("ok", "", True) and outcome["skip"][3] == 1.0
        assert outcome["missing_everywhere"] == ("ok", "", True)
        assert outcome["alive"] == 3.0
