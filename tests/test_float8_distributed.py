"""Muon on a float8-trained model (torchao's ``convert_to_float8_training``) under FSDP2.

With float8 all-gather on, every converted linear's sharded weight is a DTensor whose local
tensor is torchao's ``WeightWithDynamicFloat8CastTensor`` (an fp32 tensor in a subclass that
casts itself to float8 when FSDP2 all-gathers it). Muon reads its gradients (plain DTensors from
the reduce-scatter) and writes its weights in place through the subclass. The float8 matmuls
change the gradients, not the optimizer: given the same gradients, the step on the converted
model must equal the step on the unconverted one bit for bit (the same fp32 elements, the same
operations). ``emulate=True`` runs torchao's float8 matmuls in fp32 on the CPU (its CI mode).
"""

import copy

import pytest
import torch
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from titan_muon import Muon, build_param_groups
from titan_muon.base.dtensor import local_shard

pytest.importorskip("torchao.float8", reason="float8 training needs torchao (the torchtitan extra)")

pytestmark = pytest.mark.timeout(600)

STEPS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(32)
        self.w1 = nn.Linear(32, 64, bias=False)
        self.w2 = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    """Two FSDP2 units of Muon matrices and norms, and a root unit with the output head (AdamW,
    also converted to float8) beside a norm. Every unit keeps an fp32 norm beside its float8
    weights: FSDP2 then all-gathers the unit as bytes, as in torchtitan's llama3; a unit of
    float8 weights alone would all-gather in a float8 dtype, which gloo rejects ("Invalid
    scalar type"; NCCL takes it)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(32)
        self.output = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _sharded(model: nn.Module, mesh) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The fp32 elements of a tensor that may be torchao's weight subclass."""
    return getattr(t, "_tensor", t).detach().clone()


def _float8_config():
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)


def _steps(rank, world, overrides):
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    plain = Net()
    float8 = convert_to_float8_training(copy.deepcopy(plain), config=_float8_config())
    mesh = init_device_mesh("cpu", (world,))
    plain, float8 = _sharded(plain, mesh), _sharded(float8, mesh)
    kinds = {n: type(p.to_local()).__name__ for n, p in float8.named_parameters()}
    optimizers = [Muon(build_param_groups(m, adamw_lr=3e-3), lr=0.02, **overrides) for m in (plain, float8)]
    for step in range(STEPS):
        # The converted model's own forward and backward (float8 all-gather of the weights the
        # last step wrote, emulated float8 matmuls; with overlap its hooks send the gradients
        # during this backward), then the same gradients on the plain model.
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        float8(x).square().mean().backward()
        grads = {n: p.grad for n, p in float8.named_parameters()}
        for name, p in plain.named_parameters():
            assert type(grads[name].to_local()) is torch.Tensor, name  # the reduce-scatter's output
            p.grad = DTensor.from_local(grads[name].to_local().clone(), mesh, p.placements, shape=p.shape, stride=p.stride())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert {n: type(p.to_local()).__name__ for n, p in float8.named_parameters()} == kinds  # still wrapped
    weights = {n: _plain(p.full_tensor()) for n, p in plain.named_parameters()}
    stepped = {n: _plain(p.full_tensor()) for n, p in float8.named_parameters()}
    state = [
        {n: {k: type(local_shard(v)).__name__ for k, v in opt.state[p].items()} for n, p in m.named_parameters()}
        for opt, m in zip(optimizers, (plain, float8))
    ]
    # What the next forward all-gathers: the converted model's output on its stepped weights equals
    # an unsharded float8 model's (no FSDP, same emulated casts) given the plain run's weights.
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(99))
    check = convert_to_float8_training(Net(), config=_float8_config())
    check.load_state_dict(weights)
    with torch.no_grad():
        outputs = (float8(x), check(x))
    return {
        "plain": weights,
        "float8": stepped,
        "kinds": kinds,
        "outputs": outputs,
        "state": state,
    }


@pytest.mark.parametrize(
    "overrides",
    [{}, {"momentum_dtype": "fp8"}, {"overlap": True}],
    ids=["fp32-momentum", "fp8-momentum", "overlap"],
)
def test_step_on_float8_model_equals_unconverted_model(overrides):
    for rank, result in enumerate(run_distributed(_steps, 2, overrides, timeout=300)):
        # every linear (Muon's hidden matrices and the AdamW output head) is wrapped
        assert {n for n, kind in result["kinds"].items() if kind == "WeightWithDynamicFloat8CastTensor"} == {
            "layers.0.w1.weight", "layers.0.w2.weight", "layers.1.w1.weight", "layers.1.w2.weight", "output.weight",
        }, result["kinds"]  # fmt: skip
        for name, expected in result["plain"].items():
            assert torch.equal(result["float8"][name], expected), f"rank {rank}: {name}"  # bit for bit
        # the optimizer state holds no float8 subclass: the same keys and tensor types as the plain model's
        assert result["state"][0] == result["state"][1]
        assert "WeightWithDynamicFloat8CastTensor" not in str(result["state"][1])
        got, expected = result["outputs"]
        assert torch.equal(_plain(got), _plain(expected)), f"rank {rank}: output after the steps"
