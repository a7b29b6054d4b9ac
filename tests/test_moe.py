"""MoE experts with Muon: a grouped expert weight [experts, out, in] is a stack of matrices, each
expert orthogonalized on its own and scaled by its own shape.

One process against an independent per-expert reference; W gloo ranks (hand-made DTensors,
tests/distributed.py, with timeouts) against one process, with the experts sharded over the
expert dimension (FSDP2's Shard(0)) and over expert parallel x FSDP as torchtitan places them,
uneven expert counts, experts that receive no tokens (zero gradient on every rank), the same
state keys on every rank, and a DCP save on one layout loaded on another.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from reference import ReferenceMuonAdamW
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_muon import Muon, build_param_groups

# Expert stacks: 6 and 5 experts split unevenly over 2, 3 and 4 ranks; 2 experts leave a rank
# of 3 with none. w1/w3 are tall (update scale sqrt(12/8)), w2 and few wide.
EXPERTS = {"w1": (6, 12, 8), "w2": (6, 8, 12), "w3": (5, 12, 8), "few": (2, 6, 10)}
SHAPES = {**EXPERTS, "shared": (12, 8), "router": (6, 8)}  # a shared expert (Muon), the router (AdamW)
MUON = set(EXPERTS) | {"shared"}
NEVER_ROUTED = {"w1": [1], "w2": [1], "w3": [4], "few": [0]}  # zero gradient at every step
IDLE_FROM_STEP = 2
IDLE_LATER = {"w1": [3], "w2": [3], "w3": [0]}  # tokens at steps 0-1, none from step 2 on
STEPS = 4
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, exchange_memory_mb=0.002)
MOE_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "moe_mla_muon.toml"
OWNER_FP8 = {"overlap": True, "momentum_dtype": "fp8"}  # momentum on owners, stored in fp8


def initial_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def moe_grads(step: int) -> dict[str, torch.Tensor]:
    """Full gradients; experts without tokens get exact zeros, as torchtitan's experts do."""
    g = torch.Generator().manual_seed(1000 + step)
    grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    for name, experts in NEVER_ROUTED.items():
        grads[name][experts] = 0
    if step >= IDLE_FROM_STEP:
        for name, experts in IDLE_LATER.items():
            grads[name][experts] = 0
    return grads


def muon_groups(tensors: dict[str, torch.Tensor]) -> list[dict]:
    return [
        {"params": [(n, t) for n, t in tensors.items() if n in MUON], "matrix_stacks": True},  # experts: one matrix each
        {"params": [(n, t) for n, t in tensors.items() if n not in MUON], "use_muon": False},
    ]


def one_process(steps: int = STEPS, **overrides) -> dict[str, torch.Tensor]:
    tensors = {n: nn.Parameter(p) for n, p in initial_params().items()}
    opt = Muon(muon_groups(tensors), **{**SETTINGS, **overrides})
    for s in range(steps):
        for n, g in moe_grads(s).items():
            tensors[n].grad = g
        opt.step()
    return {n: t.detach() for n, t in tensors.items()}


def per_expert_reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Every expert as a parameter of its own, in the plain fp32 reference (tests/reference.py)."""

    def by_expert(tensors: dict[str, torch.Tensor]) -> dict[tuple, torch.Tensor]:
        return {
            (name, e): t[e] if name in EXPERTS else t
            for name, t in tensors.items()
            for e in range(t.shape[0] if name in EXPERTS else 1)
        }

    params = {key: t.clone() for key, t in by_expert(initial_params()).items()}
    muon = {key: key[0] in MUON for key in params}
    reference = ReferenceMuonAdamW(lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"], momentum=SETTINGS["momentum"])
    for s in range(steps):
        reference.step(params, by_expert(moe_grads(s)), muon)
    return {
        name: torch.stack([params[(name, e)] for e in range(shape[0])]) if name in EXPERTS else params[(name, 0)]
        for name, shape in SHAPES.items()
    }


# ------------------------------------------------------------------ one process


def test_each_expert_is_orthogonalized_on_its_own():
    ours, expected = one_process(), per_expert_reference()
    initial = initial_params()
    for name in SHAPES:
        step = expected[name] - initial[name]
        # fp32 throughout; only the order of operations differs (batched matrices, fused
        # weight decay): ~6e-8 of the parameters measured, far below the updates (~5e-2).
        assert (ours[name] - expected[name]).abs().max() <= 1e-6 * initial[name].abs().max(), name
        assert step.abs().max() > 1e-3, name


def test_experts_without_tokens_decay_and_keep_their_momentum():
    ours, initial = one_process(), initial_params()
    decay = (1 - SETTINGS["lr"] * SETTINGS["weight_decay"]) ** STEPS
    for name, experts in NEVER_ROUTED.items():  # zero momentum, zero update: weight decay only
        torch.testing.assert_close(ours[name][experts], initial[name][experts] * decay, rtol=1e-6, atol=0)
    for name, experts in IDLE_LATER.items():  # their decaying momentum still moves them
        assert (ours[name][experts] - initial[name][experts] * decay).abs().max() > 1e-3, name


def tiny_moe_model(device: torch.device) -> nn.Module:
    """torchtitan's DeepSeek-V3 with the tiny_moe flavor: 1 dense layer, 1 MoE layer of 6 experts."""
    from torchtitan.config import JobConfig
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    from titan_muon.torchtitan.v022.specs import MLA_FLAVORS

    args = copy.deepcopy(MLA_FLAVORS["tiny_moe"])
    args.update_from_config(JobConfig())  # as torchtitan's trainer does
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepSeekV3Model(args)
    if device.type != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    return model


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3)


def test_build_param_groups_puts_routed_experts_in_muon_and_the_router_in_adamw():
    model = tiny_moe_model(torch.device("meta"))
    with torch.device("meta"):
        conv = _Conv()
    muon, adamw = build_param_groups(model)
    assert {"layers.1.moe.experts.w1", "layers.1.moe.experts.w2", "layers.1.moe.experts.w3"} <= set(muon["param_names"])
    assert "layers.1.moe.shared_experts.w1.weight" in muon["param_names"]
    assert "layers.1.moe.router.gate.weight" in adamw["param_names"]
    assert "layers.1.moe.expert_bias" not in muon["param_names"] + adamw["param_names"]  # a buffer
    assert all(p.ndim == 3 for n, p in zip(muon["param_names"], muon["params"]) if ".experts." in n)
    # Hugging Face names: the router is mlp.gate; gate_proj is an MLP matrix; fused experts are 3-D.
    hf = [
        ("model.layers.0.mlp.gate.weight", nn.Parameter(torch.zeros(8, 16))),
        ("model.layers.0.mlp.gate_proj.weight", nn.Parameter(torch.zeros(32, 16))),
        ("model.layers.0.mlp.experts.down_proj", nn.Parameter(torch.zeros(8, 16, 32))),
    ]
    hf_muon, hf_adamw = build_param_groups(hf)
    assert hf_muon["param_names"] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.experts.down_proj"]
    assert hf_adamw["param_names"] == ["model.layers.0.mlp.gate.weight"]
    # Other 3-D tensors (a convolution's [out, in, kernel]) stay AdamW unless a pattern forces them.
    (adamw_only,) = build_param_groups(conv)
    assert adamw_only["use_muon"] is False and "conv.weight" in adamw_only["param_names"]
    forced, _ = build_param_groups(conv, muon_patterns=["conv.weight"])
    assert forced["param_names"] == ["conv.weight"]


def test_cpu_adaptation_counts_integer_tokens_like_cuda(monkeypatch):
    """torchtitan's router counts tokens per expert with torch.histc on int64 expert indices."""
    from titan_muon.torchtitan.cpu import count_integers_on_cpu

    torch_histc = getattr(torch.histc, "__wrapped__", torch.histc)  # torch's own, even if adapted already
    indices = torch.tensor([0, 2, 2, 5, 1, 2, 0], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        torch_histc(indices, bins=6, min=0, max=6)
    floats = torch.rand(50) * 6
    expected_floats = torch_histc(floats, bins=6, min=0, max=6)
    monkeypatch.setattr(torch, "histc", torch_histc)  # restored after the test
    count_integers_on_cpu()
    counts = torch.histc(indices, bins=6, min=0, max=6)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(indices, minlength=6).tolist()
    assert torch.equal(torch.histc(floats, bins=6, min=0, max=6), expected_floats)  # unchanged


class _OneProcess:
    """The parts of torchtitan's ParallelDims the builders read, for one process: no meshes."""

    cp_enabled = pp_enabled = False
    cp = 1  # context parallel degree (MuonClip refuses > 1)

    def get_optional_mesh(self, dims):
        return None


def test_torchtitan_load_balancing_hook_runs_on_the_muon_container(monkeypatch):
    import torchtitan.components.optimizer
    from torchtitan.config import ConfigManager

    from titan_muon.torchtitan.cpu import count_integers_on_cpu
    from titan_muon.torchtitan.v022.optimizer import MuonOptimizersContainer, build_optimizers_with_moe_load_balancing

    monkeypatch.setattr(torch, "histc", torch.histc)  # restored after the test
    count_integers_on_cpu()
    model = tiny_moe_model(torch.device("cpu"))
    config = ConfigManager().parse_args(["--job.config_file", str(MOE_TOML), "--model.flavor", "tiny_moe"])
    torchtitan_builder = torchtitan.components.optimizer.build_optimizers
    optimizers = build_optimizers_with_moe_load_balancing([model], config.optimizer, _OneProcess())
    assert isinstance(optimizers, MuonOptimizersContainer)
    assert torchtitan.components.optimizer.build_optimizers is torchtitan_builder  # rebound for the call only
    moe = model.layers["1"].moe
    assert "layers.1.moe.experts.w1" in optimizers.optimizers[0].param_groups[0]["param_names"]
    for step in range(2):
        tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(step))
        model(tokens).float().logsumexp(-1).mean().backward()
        counted = moe.tokens_per_expert.clone()
        optimizers.step()
        optimizers.zero_grad()
        assert counted.sum() == 2 * 32 * 2  # top-2
        assert moe.tokens_per_expert.sum() == 0  # the hook consumed the counts
    # Each step moves every bias by ±1e-3 (load_balance_coeff) less the mean.
    assert moe.expert_bias.abs().max() > 1e-4


# -------------------------------------------------------------- W ranks (gloo)


def _piece(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Chunk `index` of a torch.chunk-style split (ceil-sized chunks, trailing ones short or empty)."""
    size = -(-t.shape[dim] // parts)
    start = min(index * size, t.shape[dim])
    return t.narrow(dim, start, min(size, t.shape[dim] - start))


def _layout(name: str, layout: str, world: int, meshes: dict):
    """(mesh, placements, local block of a full tensor) of parameter `name`.

    "fsdp": FSDP2 on one mesh dimension, Shard(0) (experts split over the expert dimension).
    "ep": torchtitan's EP x FSDP on a (efsdp, ep) mesh: expert parallel splits experts; FSDP
    then splits each EP rank's experts (_StridedShard(0)), or their rows (Shard(1)) when
    efsdp * ep exceeds the number of experts. Dense parameters: FSDP over all ranks.
    """
    if layout == "fsdp" or name not in EXPERTS:
        return meshes["dense"], (Shard(0),), lambda full: _piece(full, 0, world, dist.get_rank())
    mesh = meshes["sparse"]
    efsdp, ep = mesh.get_coordinate()
    efsdp_size, ep_size = mesh.shape
    if efsdp_size * ep_size <= SHAPES[name][0]:
        placements = (_StridedShard(0, split_factor=ep_size), Shard(0))
        return mesh, placements, lambda full: _piece(_piece(full, 0, ep_size, ep), 0, efsdp_size, efsdp)
    return mesh, (Shard(1), Shard(0)), lambda full: _piece(_piece(full, 0, ep_size, ep), 1, efsdp_size, efsdp)


def _distribute(full: torch.Tensor, mesh, placements, local_of, check: bool = False) -> DTensor:
    dt = DTensor.from_local(local_of(full).clone(), mesh, placements, shape=full.shape, stride=full.stride())
    if check:
        assert torch.equal(dt.full_tensor(), full)  # the hand-made block is where DTensor puts it
    return dt


def _meshes(layout: str, world: int) -> dict:
    meshes = {"dense": init_device_mesh("cpu", (world,))}
    if layout == "ep":
        meshes["sparse"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    return meshes


def _sharded_module(layout, world, meshes, seed=0):
    module, layouts = nn.Module(), {}
    for name, full in initial_params(seed).items():
        layouts[name] = _layout(name, layout, world, meshes)
        module.register_parameter(name, nn.Parameter(_distribute(full, *layouts[name], check=True)))
    return module, layouts


def _set_grads(module, layouts, step):
    for name, full in moe_grads(step).items():
        getattr(module, name).grad = _distribute(full, *layouts[name])


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # as torchtitan checkpoints


def _train(rank, world, layout, overrides, steps=STEPS, save_at=None, checkpoint=None):
    meshes = _meshes(layout, world)
    module, layouts = _sharded_module(layout, world, meshes)
    opt = Muon(muon_groups(dict(module.named_parameters())), **{**SETTINGS, **overrides})
    for s in range(steps):
        if s == save_at:
            _, optim_sd = get_state_dict(module, opt, options=FLAT)
            dcp.save({"model": module.state_dict(), "optim": optim_sd}, checkpoint_id=checkpoint)
        _set_grads(module, layouts, s)
        opt.step()
    return _summary(module, opt)


def _summary(module, opt) -> dict:
    _, flat = get_state_dict(module, opt, options=FLAT)
    return {
        "params": {n: p.full_tensor() for n, p in module.named_parameters()},
        "state_keys": {n: sorted(opt.state[p]) for n, p in module.named_parameters()},
        "flat_keys": sorted(flat),
        "local_experts": {n: getattr(module, n).to_local().shape[0] for n in EXPERTS},
    }


def _assert_equal_to_one_process(results, overrides):
    expected = one_process(**overrides)
    for rank, result in enumerate(results):
        for name in SHAPES:
            # fp32 on every layout: owners orthogonalize the same whole matrices; only the
            # packing differs (exact), so differences are rounding of sums at most (~1e-7).
            diff = (result["params"][name] - expected[name]).abs().max().item()
            assert diff <= 1e-5, (rank, name, diff)
        # Every rank has the same state keys for every parameter, experts without tokens and
        # ranks without experts included (DCP hangs when they differ, dion#89).
        assert result["state_keys"] == results[0]["state_keys"], rank
        assert result["flat_keys"] == results[0]["flat_keys"], rank


RESUME_STEP = 2


@pytest.fixture(scope="module")
def saved_on_fsdp(tmp_path_factory) -> tuple[list, str]:
    """2 FSDP ranks, momentum on owners in fp8; a DCP checkpoint (flattened, as torchtitan's) at step 2."""
    checkpoint = str(tmp_path_factory.mktemp("moe_dcp") / f"step{RESUME_STEP}")
    return run_distributed(_train, 2, "fsdp", OWNER_FP8, STEPS, RESUME_STEP, checkpoint, timeout=120), checkpoint


def test_fsdp_2_ranks_equal_one_process(saved_on_fsdp):
    _assert_equal_to_one_process(saved_on_fsdp[0], OWNER_FP8)


@pytest.mark.parametrize("layout, world", [("fsdp", 3), ("ep", 4)], ids=["fsdp-3", "ep2xfsdp2"])
def test_sharded_experts_equal_one_process(layout, world):
    results = run_distributed(_train, world, layout, {}, timeout=120)
    _assert_equal_to_one_process(results, {})
    if layout == "fsdp":
        assert [r["local_experts"]["few"] for r in results] == [1, 1, 0]  # a rank with no expert of "few"
    else:  # 5 experts split 3 | 2 by EP, then 2 | 1 and 1 | 1 by FSDP; "few": efsdp x ep = 4 > 2 experts, FSDP splits rows
        assert [r["local_experts"]["w3"] for r in results] == [2, 1, 1, 1]
        assert [r["local_experts"]["few"] for r in results] == [1, 1, 1, 1]


def _load_and_continue(rank, world, layout, overrides, checkpoint, resume_step):
    meshes = _meshes(layout, world)
    module, layouts = _sharded_module(layout, world, meshes, seed=123)  # other weights: the load overwrites them
    opt = Muon(muon_groups(dict(module.named_parameters())), **{**SETTINGS, **overrides})
    _, optim_sd = get_state_dict(module, opt, options=FLAT)  # creates the state, as torchtitan does
    state = {"model": module.state_dict(), "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    module.load_state_dict(state["model"])
    set_state_dict(module, opt, model_state_dict={}, optim_state_dict=state["optim"], options=FLAT)
    for s in range(resume_step, STEPS):
        _set_grads(module, layouts, s)
        opt.step()
    return _summary(module, opt)


def test_checkpoint_saved_on_fsdp_loads_on_expert_parallel(saved_on_fsdp):
    """Saved at step 2 on 2 FSDP ranks, loaded on EP 2 x FSDP 2 (both with momentum on owners, fp8)."""
    checkpoint = saved_on_fsdp[1]
    results = run_distributed(_load_and_continue, 4, "ep", OWNER_FP8, checkpoint, RESUME_STEP, timeout=120)
    # fp8 codes, row scales and rounding noise follow global rows, so the resumed steps
    # compute what the straight run (and one process) computed.
    _assert_equal_to_one_process(results, OWNER_FP8)
