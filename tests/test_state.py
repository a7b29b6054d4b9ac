"""Momentum storage in one process: exactness, error bounds, keys, empty shards, checkpoint casts."""

import copy

import pytest
import torch

from titan_muon.state import FP8, MOMENTUM_DTYPES, momentum_storage

STORAGES = {
    "fp32": dict(momentum_dtype="fp32"),
    "bf16": dict(momentum_dtype="bf16"),
    "bf16-sr": dict(momentum_dtype="bf16", rounding="stochastic"),
    "fp8": dict(momentum_dtype="fp8"),
    "fp8-nearest": dict(momentum_dtype="fp8", rounding="nearest"),
    "fp8-row": dict(momentum_dtype="fp8", block_cols=10_000),
}


def _storage(kind):
    return momentum_storage(**STORAGES[kind])


def _run(storage, shape, steps, seed=0, stream=0):
    """Steps of M <- lerp(M, g, 0.05) through the storage; also the fp32 reference."""
    g = torch.Generator().manual_seed(seed)
    state, ref = storage.create(torch.zeros(shape)), torch.zeros(shape)
    row_scale = torch.logspace(-4, 1, shape[0]).unsqueeze(1)  # rows of very different size
    for _ in range(steps):
        grad = torch.randn(shape, generator=g) * row_scale
        m = storage.load(state)
        m.lerp_(grad, 0.05)
        storage.store(state, m, stream)
        ref.lerp_(grad, 0.05)
    return state, ref


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(momentum_dtype="fp16"), "momentum_dtype='fp16'"),
        (dict(momentum_dtype="fp8", rounding="up"), "rounding='up'"),
        (dict(momentum_dtype="fp32", rounding="stochastic"), "rounding='stochastic'"),
        (dict(momentum_dtype="fp8", block_cols=0), "block_cols must be a positive integer, got 0"),
    ],
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        momentum_storage(**kwargs)


def test_bad_param_and_bad_momentum_are_refused():
    storage = momentum_storage("fp8")
    with pytest.raises(ValueError, match=r"2-D.*\(4,\)"):
        storage.create(torch.zeros(4))
    state = storage.create(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"shape \(4, 7\).*\(4, 8\)"):
        storage.store(state, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        storage.store(state, torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", STORAGES)
def test_keys_are_fixed_and_state_is_tensors(kind):
    storage = _storage(kind)
    for shape in [(30, 64), (3, 1000), (0, 16)]:
        state = storage.create(torch.zeros(shape))
        assert tuple(state) == storage.keys
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        storage.store(state, storage.load(state))
        assert tuple(state) == storage.keys


def test_fp32_is_exact_and_load_is_the_buffer():
    storage = momentum_storage("fp32")
    state, ref = _run(storage, (30, 64), steps=20)
    assert torch.equal(storage.load(state), ref)
    m = storage.load(state)
    m.add_(1.0)  # the working copy is the buffer: in-place updates are the store
    assert m.data_ptr() == state["momentum_buffer"].data_ptr()


def test_bf16_is_close():
    for kind, bound in [("bf16", 0.01), ("bf16-sr", 0.015)]:
        storage = _storage(kind)
        state, ref = _run(storage, (30, 64), steps=50)
        assert state["momentum_buffer"].dtype == torch.bfloat16
        assert _rel(storage.load(state), ref) < bound, kind


@pytest.mark.parametrize("kind", ["fp8", "fp8-nearest", "fp8-row"])
def test_fp8_one_round_trip_error_bound(kind):
    """e4m3 keeps 3 mantissa bits: nearest errs by <= 2**-4 relative, stochastic by < 2**-3."""
    storage = _storage(kind)
    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 2, 16).unsqueeze(1)
    state = storage.create(x)
    storage.store(state, x.clone())
    assert state["momentum_fp8"].dtype == torch.uint8 and state["momentum_exp"].dtype == torch.int8
    q = storage.load(state)
    # a block's max lands in (224, 448]; below e4m3's normals (2**-6) the step is 2**-9 in scaled units
    scale = torch.exp2(state["momentum_exp"].float()).repeat_interleave(storage.block_cols, 1)[:, : x.shape[1]]
    relative = 2**-4 if storage.rounding == "nearest" else 2**-3
    assert ((q - x).abs() <= relative * x.abs() + 2**-9 * scale).all()
    assert _rel(q, x) < (0.03 if storage.rounding == "nearest" else 0.045)


def test_fp8_scales_put_block_max_near_448_and_representable_values_round_trip():
    storage = momentum_storage("fp8", block_cols=4)
    codes = torch.tensor([[1.0, -1.5, 448.0, 0.0, 3.0, 2.0**-9, 0.0, 0.0, 0.0, 0.0]])
    x = codes * torch.tensor([[2.0**-20] * 4 + [2.0**5] * 4 + [1.0] * 2])
    state = storage.create(x)
    storage.store(state, x.clone())
    assert torch.equal(storage.load(state), x)  # fp8 values times powers of two: exact
    assert state["momentum_exp"].tolist() == [[-20, -2, -9]]  # frexp(0) = (0, 0): any exponent serves a zero block


def test_fp8_stochastic_rounding_is_unbiased_and_nearest_is_not():
    x = torch.full((64, 256), 1.1)  # scaled to 281.6, between e4m3 neighbours 256 and 288
    for rounding, expect_unbiased in [("stochastic", True), ("nearest", False)]:
        storage = momentum_storage("fp8", rounding=rounding)
        state = storage.create(x)
        storage.store(state, x.clone())
        bias = float(storage.load(state).mean()) - 1.1
        assert (abs(bias) < 0.002) == expect_unbiased, (rounding, bias)


def test_stochastic_rounding_depends_on_step_and_stream_only():
    storage = momentum_storage("fp8")
    a, _ = _run(storage, (40, 100), steps=7, stream=3)
    b, _ = _run(storage, (40, 100), steps=7, stream=3)
    c, _ = _run(storage, (40, 100), steps=7, stream=4)
    assert all(torch.equal(a[k], b[k]) for k in storage.keys)
    assert int(a["step"]) == 7
    assert not torch.equal(a["momentum_fp8"], c["momentum_fp8"])


@pytest.mark.parametrize("kind", ["fp8", "bf16-sr"])
def test_fp8_and_bf16_sr_over_many_steps(kind):
    storage = _storage(kind)
    state, ref = _run(storage, (32, 512), steps=200)
    bound = 0.15 if kind == "fp8" else 0.015
    assert _rel(storage.load(state), ref) < bound


@pytest.mark.parametrize("kind", STORAGES)
def test_empty_shard(kind):
    storage = _storage(kind)
    state = storage.create(torch.zeros(0, 300))
    m = storage.load(state)
    assert m.shape == (0, 300) and m.dtype == torch.float32
    storage.store(state, m, stream=2)
    assert storage.load(state).shape == (0, 300)


def test_bytes_per_element():
    fp8 = momentum_storage("fp8")
    assert fp8.bytes_per_element(1024, 1024) == pytest.approx(1 + 4 / 1024 + 8 / 1024**2)
    assert fp8.bytes_per_element(1024, 1024) <= 1.1
    assert momentum_storage("fp8", block_cols=10_000).bytes_per_element(1024, 1024) == pytest.approx(1 + 1 / 1024 + 8 / 1024**2)
    assert momentum_storage("bf16").bytes_per_element(64, 64) == 2.0
    assert momentum_storage("fp32").bytes_per_element(64, 64) == 4.0
    for name in MOMENTUM_DTYPES:
        storage = momentum_storage(name)
        state = storage.create(torch.zeros(512, 768))
        actual = sum(t.numel() * t.element_size() for t in state.values()) / (512 * 768)
        assert actual == pytest.approx(storage.bytes_per_element(512, 768)), name


class _MomentumOnly(torch.optim.Optimizer):
    """Just enough optimizer to go through Optimizer.state_dict / load_state_dict."""

    def __init__(self, params, storage):
        super().__init__(params, {})
        self.storage = storage

    def step(self, grads):
        for i, p in enumerate(self.param_groups[0]["params"]):
            state = self.state[p]
            if not state:
                state.update(self.storage.create(p))
            m = self.storage.load(state)
            m.lerp_(grads[i], 0.05)
            self.storage.store(state, m, stream=i)


@pytest.mark.parametrize("kind", ["fp8", "bf16", "bf16-sr", "fp8-nearest"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_optimizer_load_state_dict_cast_is_undone(kind, param_dtype):
    """Optimizer.load_state_dict casts every state tensor but "step" to the param dtype."""
    storage = _storage(kind)
    shapes = [(30, 64), (3, 300)]
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    params = [torch.zeros(s, dtype=param_dtype, requires_grad=True) for s in shapes]
    a = _MomentumOnly(params, storage)
    for step in range(3):
        a.step(grads[step])
    b = _MomentumOnly([torch.zeros(s, dtype=param_dtype, requires_grad=True) for s in shapes], storage)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # load_state_dict keeps "step" by reference
    assert any(t.dtype == param_dtype for st in b.state.values() for k, t in st.items() if k != "step")
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        assert torch.equal(storage.load(a.state[pa]), storage.load(b.state[pb]))
    a.step(grads[3])
    b.step(grads[3])
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        for key in storage.keys:
            assert b.state[pb][key].dtype == a.state[pa][key].dtype
            assert torch.equal(a.state[pa][key], b.state[pb][key]), key


def test_fp8_codes_are_e4m3fn_bits():
    storage = momentum_storage("fp8", rounding="nearest")
    x = torch.randn(8, 64)
    state = storage.create(x)
    storage.store(state, x.clone())
    scale = torch.exp2(state["momentum_exp"].float())
    assert torch.equal(storage.load(state), state["momentum_fp8"].view(FP8).float() * scale)
