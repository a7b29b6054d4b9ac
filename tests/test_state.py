"""Momentum storage in one process: exactness, error bounds, keys, empty shards, checkpoint casts,
the stochastic-rounding noise (reference hash, statistics, layout independence), owner-held
blocks, the meta device and the per-call op count."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_muon.state.momentum import (
    FP8,
    MOMENTUM_DTYPES,
    NONFINITE_EXP,
    decode_fp8,
    momentum_storage,
    rounding_noise,
    stochastic_round_,
)

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
    # Each store rounds M by <= 2^-9 relative (stochastic: < 2^-8); with M <- 0.95 M + 0.05 g
    # the errors of past stores decay by 0.95 a step, so random-signed ones add up to about
    # 2^-9 / sqrt(1 - 0.95^2) ≈ 0.006 of |M| (stochastic twice that). Same on any CPU.
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


# ----------------------------------------------------------------------------- the noise

U32 = 0xFFFFFFFF


def _lowbias32(x):
    """Chris Wellons' lowbias32 on Python ints: the independent reference for the tensor hash."""
    x &= U32
    x ^= x >> 16
    x = x * 0x7FEB352D & U32
    x ^= x >> 15
    x = x * 0x846CA68B & U32
    return x ^ (x >> 16)


def _reference_noise(step, stream, row, col, bits):
    """The documented noise of one element, from its definition (docs/fp8_momentum.md)."""
    seed = _lowbias32(step ^ _lowbias32(stream))
    row_key = _lowbias32(row ^ seed)
    col_key = _lowbias32(col ^ seed ^ 0x9E3779B9)
    x = (row_key ^ col_key) * 0x7FEB352D & U32
    x ^= x >> 16
    x = x * 0x846CA68B & U32
    x ^= x >> 16
    return x & ((1 << bits) - 1)


def test_integer_multiplication_wraps():
    """The hash relies on int32 products wrapping mod 2**32 (two's complement), as torch's kernels do."""
    x = torch.tensor([0x7FFFFFFF, -(2**31), 123456789, -987654321], dtype=torch.int32)
    expected = [(v * 0x7FEB352D) & U32 for v in x.tolist()]
    assert [v & U32 for v in (x * 0x7FEB352D).tolist()] == expected


def test_noise_equals_the_reference_hash():
    """Bit for bit against the pure-Python definition, including a step and stream beyond 2**31."""
    for step, stream, first_row in [(1, 0, 0), (7, 3, 1000), (2**33 + 5, 2**40 + 1, 2**30)]:
        noise = rounding_noise(torch.tensor(step), stream, first_row, (5, 70), 20, "cpu")
        expected = [[_reference_noise(step, stream, first_row + i, j, 20) for j in range(70)] for i in range(5)]
        assert noise.tolist() == expected, (step, stream)
    assert rounding_noise(torch.tensor(3), 1, 0, (4, 9), 16, "cpu").max() < 2**16


def test_noise_depends_only_on_step_stream_global_row_and_column():
    """Any split of the rows (any W, any rank, an owner's block) sees the same noise: bit-exact."""
    step = torch.tensor(11)
    whole = rounding_noise(step, 4, 0, (37, 300), 20, "cpu")
    for first, rows in [(0, 37), (5, 9), (36, 1), (20, 0), (19, 18)]:
        assert torch.equal(rounding_noise(step, 4, first, (rows, 300), 20, "cpu"), whole[first : first + rows])
    assert not torch.equal(rounding_noise(torch.tensor(12), 4, 0, (37, 300), 20, "cpu"), whole)
    assert not torch.equal(rounding_noise(step, 5, 0, (37, 300), 20, "cpu"), whole)


def _bit_means(u, bits=20):
    """Per bit b < bits, the mean over elements of +-1 (bit b of the element set or not)."""
    return torch.stack([((u >> b) & 1).sum() for b in range(bits)]).double() * 2 / u.numel() - 1


def test_noise_bits_are_uniform_and_independent():
    """Every bit of 20 is a fair coin, uncorrelated with the same bit of its neighbours, of the next
    step, of the next stream and of rows 2**20 away.

    The noise is deterministic (integer math, the same on every machine), so this is a fixed
    check, not a flaky one. Bound: 5 standard errors of a mean of n independent +-1 values
    (1/sqrt(n)); 100 such statistics of a good hash exceed 5 with probability ~6e-5.
    """
    rows, cols = 256, 512
    u = rounding_noise(torch.tensor(7), 5, 0, (rows, cols), 20, "cpu")
    limit = 5 / math.sqrt(rows * cols)
    others = {
        "next column": u.roll(1, 1),
        "next row": u.roll(1, 0),
        "next step": rounding_noise(torch.tensor(8), 5, 0, (rows, cols), 20, "cpu"),
        "next stream": rounding_noise(torch.tensor(7), 6, 0, (rows, cols), 20, "cpu"),
        "rows 2**20 away": rounding_noise(torch.tensor(7), 5, 2**20, (rows, cols), 20, "cpu"),
    }
    assert _bit_means(u).abs().max() < limit
    for name, v in others.items():
        correlation = -_bit_means(u ^ v)  # per bit: mean of (+-1)(+-1) = -(mean of +-1 for the XOR)
        assert correlation.abs().max() < limit, (name, correlation)


def _top_singular_value(matrix, iterations=60):
    """Power iteration from a fixed random start: finds a separated outlier, slightly under-reads the bulk edge."""
    v = torch.randn(matrix.shape[1], generator=torch.Generator().manual_seed(0))
    for _ in range(iterations):
        v = matrix.T @ (matrix @ v)
        v /= v.norm()
    return float((matrix @ v).norm())


def test_noise_has_no_matrix_structure():
    """Rounding decisions form no low-rank pattern that Newton-Schulz would lift.

    E = 1[u < f] - f has independent entries of variance f(1 - f) for a good hash, so its
    largest singular value is sqrt(f(1 - f)) (sqrt(rows) + sqrt(cols)) up to finite-size
    corrections of a few per cent (Bai-Yin; the hash measures 0.99 here). Structure shows as
    outliers that grow with the size; measured at this size (docs/fp8_momentum.md): row key
    XOR column key alone 6.5-19x, plus one multiply 1.12-1.24x, plus multiply and fold
    1.45-1.5x. Bound 1.1 separates them.
    Also: the 4-point XOR u(r,c)^u(r,c')^u(r',c)^u(r',c') is 0 for XOR-combined keys; each of
    its bits must be a fair coin (5 standard errors, as above; one multiply alone reaches 9.7).
    """
    rows, cols = 1024, 2048
    u = rounding_noise(torch.tensor(3), 2, 64, (rows, cols), 20, "cpu")
    for f in (0.5, 0.1):
        errors = (u < f * 2**20).float() - f
        ratio = _top_singular_value(errors) / (math.sqrt(f * (1 - f)) * (math.sqrt(rows) + math.sqrt(cols)))
        assert ratio < 1.1, (f, ratio)
    for dr, dc in [(1, 1), (1, 256), (128, 1)]:
        q = u[dr:, dc:] ^ u[dr:, :-dc] ^ u[:-dr, dc:] ^ u[:-dr, :-dc]
        assert _bit_means(q).abs().max() < 5 / math.sqrt(q.numel()), (dr, dc)


def test_stochastic_round_rounds_up_with_the_dropped_fraction():
    """x = 1 + 3 * 2**-23 has 3 in its 20 dropped mantissa bits: over all 2**20 noise values it
    rounds up for exactly 3 of them (probability = the dropped fraction), for either sign."""
    x = torch.full((1, 2**20), 1.0 + 3 * 2**-23, dtype=torch.float32)  # dropped field = 3 (of 2**20)
    noise = torch.arange(2**20, dtype=torch.int32).unsqueeze(0)
    rounded = stochastic_round_(noise, x, 20).view(torch.float32)
    assert int((rounded > 1.0).sum()) == 3 and int((rounded == 1.0).sum()) == 2**20 - 3
    negative = stochastic_round_(torch.arange(2**20, dtype=torch.int32).unsqueeze(0), -x, 20).view(torch.float32)
    assert torch.equal(negative, -rounded)  # the magnitude rounds: symmetric in sign


def test_bf16_stochastic_rounding_uses_the_same_noise():
    storage = momentum_storage("bf16", rounding="stochastic")
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    state = storage.create_block(6, 40, "cpu")
    storage.store(state, x.clone(), stream=9, first_row=4)
    noise = rounding_noise(torch.tensor(1), 9, 4, (6, 40), 16, "cpu")  # step 1: the first store
    expected = stochastic_round_(noise, x, 16).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(state["momentum_buffer"], expected)


# ----------------------------------------------------------------------------- fp8 decode and blocks


@pytest.mark.parametrize("exponent", [-126, -9, 0, 7, 8, 100])
def test_fp8_decode_equals_torch_cast_for_every_code(exponent):
    """decode_fp8 builds values from bits; torch's own e4m3fn cast is the independent reference.

    Every non-NaN code (subnormals included) times 2**exponent, exactly. NaN codes (0x7F, 0xFF)
    are never written for a finite block (its maximum maps to <= 448); blocks that held Inf/NaN
    are marked by their exponent instead (next test).
    """
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).unsqueeze(0)
    exps = torch.full((1, 1), exponent, dtype=torch.int8)
    got = decode_fp8(codes, exps, 256)
    reference = codes.view(FP8).double() * 2.0**exponent
    finite = (codes.view(FP8).float().isfinite()).squeeze(0)
    assert torch.equal(got[0, finite], reference[0, finite].float())


def test_fp8_nonfinite_block_reads_nan_and_other_blocks_are_untouched():
    storage = momentum_storage("fp8", block_cols=4)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, float("nan"), 7.0, 8.0, 9.0, float("inf")]])
    state = storage.create(x)
    storage.store(state, x.clone())
    assert state["momentum_exp"][0].tolist()[1:] == [NONFINITE_EXP, NONFINITE_EXP]
    loaded = storage.load(state)
    assert loaded[0, 4:].isnan().all()
    assert torch.equal(loaded[0, :4], x[0, :4])  # small integers are exact in e4m3


@pytest.mark.parametrize("cols", [1, 255, 256, 512, 700])
def test_fp8_ragged_and_whole_blocks_match_one_block_per_row(cols):
    """Vectorized blocks: the same codes as storing each block on its own (a plain per-block reference)."""
    block = 256
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(cols)) * torch.logspace(-3, 3, cols)
    storage = momentum_storage("fp8", rounding="nearest", block_cols=block)
    state = storage.create(x)
    storage.store(state, x.clone())
    row_storage = momentum_storage("fp8", rounding="nearest", block_cols=10**6)
    for b, start in enumerate(range(0, cols, block)):
        piece = x[:, start : start + block].contiguous()
        ref = row_storage.create(piece)
        row_storage.store(ref, piece.clone())
        assert torch.equal(state["momentum_fp8"][:, start : start + block], ref["momentum_fp8"])
        assert torch.equal(state["momentum_exp"][:, b : b + 1], ref["momentum_exp"])


# ----------------------------------------------------------------------------- owner-held blocks


@pytest.mark.parametrize("kind", ["fp8", "fp8-nearest", "bf16-sr", "bf16", "fp32"])
def test_block_on_an_owner_equals_the_same_rows_of_the_whole_matrix(kind):
    """create_block + store(first_row=...) on plain tensors == those rows of the whole-matrix state, bit for bit."""
    storage = _storage(kind)
    shape, first, rows = (23, 300), 7, 11
    whole = storage.create(torch.zeros(shape))
    block = storage.create_block(rows, shape[1], "cpu")
    assert tuple(block) == storage.keys
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        grad = torch.randn(shape, generator=g)
        m = storage.load(whole)
        m.lerp_(grad, 0.1)
        storage.store(whole, m, stream=3)
        b = storage.load(block)
        b.lerp_(grad[first : first + rows], 0.1)
        storage.store(block, b, stream=3, first_row=first)
    for key in storage.keys:
        if key == "step":
            assert int(block[key]) == int(whole[key]) == 4
        else:
            assert torch.equal(block[key], whole[key][first : first + rows]), key
    assert torch.equal(storage.load(block), storage.load(whole)[first : first + rows])


def test_bad_first_row_and_block_shape_are_refused():
    storage = momentum_storage("fp8")
    state = storage.create_block(4, 8, "cpu")
    with pytest.raises(ValueError, match="first_row must be a non-negative int, got -1"):
        storage.store(state, torch.zeros(4, 8), first_row=-1)
    with pytest.raises(ValueError, match=r"two non-negative ints, got \(4, -8\)"):
        storage.create_block(4, -8, "cpu")


# ----------------------------------------------------------------------------- device discipline


@pytest.mark.parametrize("kind", STORAGES)
def test_meta_device_create_load_store_give_shapes_and_dtypes(kind):
    """Shapes only: no op reads a value (an .item() on meta raises), so this is also the proof
    that load and store never read a device tensor on the host."""
    storage = _storage(kind)
    for state in (storage.create(torch.empty(30, 300, device="meta")), storage.create_block(30, 300, "meta")):
        m = storage.load(state)
        assert m.device.type == "meta" and m.shape == (30, 300) and m.dtype == torch.float32
        storage.store(state, torch.empty(30, 300, device="meta"), stream=1)
        assert tuple(state) == storage.keys
        for key, value in state.items():
            if key == "step":
                assert value.device.type == "cpu" and value.dtype == torch.int64 and int(value) == 1
            else:
                assert value.device.type == "meta" and value.shape[0] == 30, key
    if kind.startswith("fp8"):
        assert state["momentum_fp8"].dtype == torch.uint8 and state["momentum_fp8"].shape == (30, 300)
        assert state["momentum_exp"].dtype == torch.int8 and state["momentum_exp"].shape == (30, -(-300 // storage.block_cols))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


VIEW_OPS = {"view", "detach", "slice", "unsqueeze", "select", "split_with_sizes", "alias"}  # metadata only, no kernel


@pytest.mark.parametrize("kind", ["fp8", "fp8-nearest", "bf16-sr"])
def test_store_and_load_run_a_fixed_number_of_ops_and_never_read_a_value(kind):
    """O(1) ops per call: the same ops for a tiny matrix and one with 56 column blocks and a
    ragged last one; no _local_scalar_dense (.item(), int(t)) and no aten.equal.

    Bound: the measured count (fp8 store + load: 79 ops that compute, 14 of them on the CPU
    step scalar) with room for small changes; a loop per block or per row group would already
    fail the equality.
    """
    storage = _storage(kind)
    ops = []
    for shape in [(3, 300), (64, 56 * 256 + 40)]:
        state = storage.create(torch.zeros(shape))
        with _CountOps() as mode:
            storage.store(state, storage.load(state), stream=2)
        assert not {"aten._local_scalar_dense", "aten.equal", "aten.item"} & set(mode.ops), mode.ops
        ops.append(mode.ops)
    assert ops[0] == ops[1]
    computing = [op for op in ops[0] if op.removeprefix("aten.") not in VIEW_OPS]
    assert len(computing) <= 90, (len(computing), computing)
