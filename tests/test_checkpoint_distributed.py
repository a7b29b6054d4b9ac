"""DCP: Muon/AdamW state saved on 2 ranks loads on 1, 3 and 4 ranks and the next step matches."""

import pytest
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from sharded_fixtures import distributed_params, muon_for, set_grads, check_equal_to_one_process
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

SAVED_STEPS = 3


def _save(rank, world, checkpoint, overrides=None):
    mesh = init_device_mesh("cpu", (world,))
    module = distributed_params(mesh, [Shard(0)])
    opt = muon_for(module, **(overrides or {}))
    for s in range(SAVED_STEPS):
        set_grads(module, s, mesh, [Shard(0)])
        opt.step()
    model_sd, optim_sd = get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    set_grads(module, SAVED_STEPS, mesh, [Shard(0)])
    opt.step()
    return {n: p.full_tensor() for n, p in module.named_parameters()}


def _load_and_step(rank, world, checkpoint, overrides=None):
    mesh = init_device_mesh("cpu", (world,))
    module = distributed_params(mesh, [Shard(0)], seed=123)  # other weights: the load must overwrite them
    opt = muon_for(module, **(overrides or {}))
    model_sd, optim_sd = get_state_dict(module, opt)  # creates state with a no-op lr=0 step
    for key in opt.storage.keys:
        if key != "step":
            assert isinstance(opt.state[module.a][key], DTensor) and opt.state[module.a][key].placements == (Shard(0),)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    set_grads(module, SAVED_STEPS, mesh, [Shard(0)])
    opt.step()
    return {n: p.full_tensor() for n, p in module.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    checkpoint = str(tmp_path_factory.mktemp("dcp") / "step3")
    return checkpoint, run_distributed(_save, 2, checkpoint)[0]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_and_resume_matches(saved, world):
    checkpoint, expected = saved
    for rank, result in enumerate(run_distributed(_load_and_step, world, checkpoint)):
        # Every run is given the same gradients: only rounding may differ, as between W ranks
        # and one process (4 steps in all).
        check_equal_to_one_process(result, expected, SAVED_STEPS + 1, f"W={world} rank {rank}")


def test_fp8_momentum_reshards_2_to_3(tmp_path):
    """fp8 codes and scales follow rows, so a 2 -> 3 reshard (torchao's block layout fails it) is exact."""
    checkpoint, fp8 = str(tmp_path / "fp8"), {"momentum_dtype": "fp8"}
    expected = run_distributed(_save, 2, checkpoint, fp8)[0]
    for rank, result in enumerate(run_distributed(_load_and_step, 3, checkpoint, fp8)):
        check_equal_to_one_process(result, expected, SAVED_STEPS + 1, f"rank {rank}")
