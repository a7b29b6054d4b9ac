"""Tensor parallel with exact math: FSDP2 over TP (strided row shards, row-wise column blocks)
gives the one-process result, Split included — each matrix is assembled whole on its owner."""

import pytest
import torch
from common import FP32_ULP, adamw_names, assert_within, feed_adamw_gradients, whole_gradients
from distributed import run_distributed
from sharded_fixtures import TinyTransformerish, token_batches, next_token_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_muon import Muon, build_param_groups

SETTINGS = dict(lr=0.02, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.002)
SPLIT = {"layers.*.wq.weight": 4}  # 24 rows = 6 heads: TP halves hold 3, FSDP quarters 1.5 (heads straddle)
TP_PLAN = {
    "wq": ColwiseParallel(output_layouts=Replicate()),
    "wk": ColwiseParallel(),
    "wo": RowwiseParallel(),
    "w1": ColwiseParallel(),
    "w2": RowwiseParallel(),
}


# wk and wo left out: replicated over TP, so sharded over the dp ranks only, while wq, w1 and w2
# are sharded over dp x tp — two rank sets in one optimizer, as torchtitan's DeepSeek-V3 TP plan
# makes them (MLA's down-projections are replicated over TP).
PARTIAL_TP_PLAN = {key: value for key, value in TP_PLAN.items() if key not in ("wk", "wo")}


def muon_for(model, split):
    return Muon(build_param_groups(model, adamw_lr=3e-3), row_blocks=SPLIT if split else None, **SETTINGS)


HIDDEN = 62  # TP halves of 31 rows (DTensor's TP matmuls need even splits), FSDP splits them 16/15


def _train(rank, world, tp, split, steps=3, plan=None):
    torch.manual_seed(0)
    model = TinyTransformerish(hidden=HIDDEN)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], plan or TP_PLAN)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = muon_for(model, split)
    dp_rank = mesh["dp"].get_local_rank()
    reduced = []
    for s in range(steps):
        tokens = token_batches(s).chunk(world // tp)[dp_rank]  # TP ranks of one replica see the same batch
        next_token_loss(model, tokens).backward()
        reduced.append(whole_gradients(model, adamw_names(opt)))
        opt.step()
        opt.zero_grad()
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "placements": placements, "adamw_grads": reduced}


def one_process_run(split, adamw_grads, steps=3):
    """AdamW is fed the gradients the ranks reduced (common.feed_adamw_gradients)."""
    torch.manual_seed(0)
    model = TinyTransformerish(hidden=HIDDEN)
    opt = muon_for(model, split)
    for s in range(steps):
        next_token_loss(model, token_batches(s)).backward()
        feed_adamw_gradients(model, opt, adamw_grads[s], f"step {s}")
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, set(adamw_names(opt))


@pytest.mark.parametrize("split,plan", [(False, None), (True, None), (False, PARTIAL_TP_PLAN)], ids=["whole", "split-heads", "two-rank-sets"])
def test_fsdp_times_tp_equals_one_process(split, plan):
    results = run_distributed(_train, 4, 2, split, 3, plan, timeout=300)
    expected, adamw = one_process_run(split, results[0]["adamw_grads"])
    placements = results[0]["placements"]
    assert "_StridedShard" in placements["layers.0.w1.weight"] or "_S(" in placements["layers.0.w1.weight"]
    assert "Shard(dim=1)" in placements["layers.0.w2.weight"]
    if plan is PARTIAL_TP_PLAN:
        assert "Replicate" not in placements["layers.0.w1.weight"] and placements["layers.0.wk.weight"].count("Shard") == 1
    for rank, result in enumerate(results):
        for name, tensor in expected.items():
            if name in adamw:  # the same gradients, elementwise: the last bit of p after each of 2 roundings a step
                bound = 3 * 2 * FP32_ULP * tensor.abs().max().item()
            else:
                # fp32; TP splits the matmuls' sums (row-wise layers add partial products) and
                # FSDP sums gradients across ranks in another order: ~1e-7 relative per step;
                # each of 3 steps moves a matrix by <= lr·0.2·sqrt(62)·1.2 ≈ 0.04.
                bound = 1e-5
            assert_within(result["params"][name], tensor, bound, f"rank {rank} {name}")


def _fp8_overlap_tp(rank, world, path, save, steps):
    """Linear 512 -> 1024 column-wise and 1024 -> 512 row-wise over TP 2, FSDP 2 on top, fp8
    momentum held by the owners: row-wise TP gives each rank 512 of 1024 columns, on fp8's
    256-column scale blocks, so the exponents have column shards of their own."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 512, bias=False))
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.set_force_sum_reduction_for_comms(True)
    opt = Muon(build_param_groups(model, muon_patterns=["*"]), lr=0.02, overlap=True, momentum_dtype="fp8", exchange_memory_mb=1)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    dp_rank = mesh["dp"].get_local_rank()
    start = 0
    if not save:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        start = 2
    for s in range(start, steps):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * s + dp_rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if save and s == 1:
            model_sd, optim_sd = get_state_dict(model, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_fp8_momentum_with_overlap_and_rowwise_tp_checkpoints_and_resumes_exactly(tmp_path):
    """Saving used to raise NotImplementedError ("momentum state with its own column blocks needs
    whole rows on every rank") at the first checkpoint. The resumed run must continue bit for bit:
    the checkpoint holds the owners' fp8 codes and exponents laid out like the parameters."""
    straight = run_distributed(_fp8_overlap_tp, 4, str(tmp_path / "ckpt"), True, 4, timeout=300)
    resumed = run_distributed(_fp8_overlap_tp, 4, str(tmp_path / "ckpt"), False, 4, timeout=300)
    for name, tensor in straight[0].items():
        assert torch.equal(resumed[0][name], tensor), name
