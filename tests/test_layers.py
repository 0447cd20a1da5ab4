"""Scoped layers: drop-in for torch's, with per-call seeds and no double updates."""

from __future__ import annotations

import copy
import io
import math
import pickle
import re
import threading
import warnings

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import functional as SF
from scopedckpt.core import _torch_private
from scopedckpt.core._engine import COUNTERS
from scopedckpt.layers import _mask

DROPOUTS = [
    (scopedckpt.Dropout, nn.Dropout, (64, 32)),
    (scopedckpt.Dropout1d, nn.Dropout1d, (64, 32, 4)),
    (scopedckpt.Dropout2d, nn.Dropout2d, (64, 32, 2, 2)),
    (scopedckpt.Dropout3d, nn.Dropout3d, (64, 32, 2, 2, 1)),
    (scopedckpt.AlphaDropout, nn.AlphaDropout, (64, 32)),
    (scopedckpt.FeatureAlphaDropout, nn.FeatureAlphaDropout, (64, 32, 4)),
]
BATCH_NORMS = [
    (scopedckpt.BatchNorm1d, nn.BatchNorm1d, (8, 3)),
    (scopedckpt.BatchNorm2d, nn.BatchNorm2d, (8, 3, 2, 2)),
    (scopedckpt.BatchNorm3d, nn.BatchNorm3d, (8, 3, 2, 2, 2)),
]


@pytest.mark.parametrize(("scoped", "torch_cls", "shape"), DROPOUTS)
def test_dropout_is_a_drop_in(scoped: type, torch_cls: type, shape: tuple[int, ...]) -> None:
    layer, reference = scoped(0.25, inplace=True), torch_cls(0.25, inplace=True)
    assert isinstance(layer, torch_cls)
    assert repr(layer) == repr(reference).replace(torch_cls.__name__, scoped.__name__)
    assert layer.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(shape)
    layer.eval()
    assert layer(x) is x


@pytest.mark.parametrize(("scoped", "torch_cls", "shape"), DROPOUTS)
def test_dropout_statistics_match_torch(
    scoped: type, torch_cls: type, shape: tuple[int, ...]
) -> None:
    """Not the same bits as torch (another RNG path) but the same distribution."""
    torch.manual_seed(0)
    if "Alpha" in scoped.__name__:
        x = torch.randn(shape)
        ours, theirs = scoped(0.3).train()(x), torch_cls(0.3).train()(x)
        for stat in (torch.mean, torch.std):
            assert abs(float(stat(ours)) - float(stat(theirs))) < 0.1
        return
    x = torch.rand(shape) + 1  # no zeros in the input
    ours, theirs = scoped(0.3)(x), torch_cls(0.3)(x)
    kept = ours != 0
    assert torch.allclose(ours[kept], x[kept] / 0.7)
    assert abs(float((ours == 0).float().mean()) - float((theirs == 0).float().mean())) < 0.1


def test_feature_dropout_drops_whole_channels() -> None:
    out = scopedckpt.Dropout2d(0.5)(torch.ones(16, 8, 3, 3))
    per_channel = out.flatten(2)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2))


def test_p_one_and_p_zero() -> None:
    x = torch.randn(4, 4)
    assert torch.equal(scopedckpt.Dropout(1.0)(x), torch.zeros(4, 4))
    assert scopedckpt.Dropout(0.0)(x) is x


def test_same_seed_same_mask_and_generator_reproduces() -> None:
    x = torch.randn(32, 32)
    torch.manual_seed(7)
    a = scopedckpt.Dropout(0.5)(x)
    torch.manual_seed(7)
    b = scopedckpt.Dropout(0.5)(x)
    assert torch.equal(a, b)
    c = scopedckpt.Dropout(0.5, generator=torch.Generator().manual_seed(1))(x)
    d = scopedckpt.Dropout(0.5, generator=torch.Generator().manual_seed(1))(x)
    assert torch.equal(c, d) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [False, True])
def test_save_mask_false_gives_the_same_bits(dtype: torch.dtype, alpha: bool) -> None:
    cls = scopedckpt.AlphaDropout if alpha else scopedckpt.Dropout
    results = []
    for save in (True, False):
        torch.manual_seed(0)
        x = torch.randn(16, 16, dtype=dtype, requires_grad=True)
        out = cls(0.3, save_mask=save)(x)
        (out.float() * torch.arange(16.0)).sum().backward()
        results.append((out, x.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_inplace_dropout_writes_into_its_input() -> None:
    x = torch.randn(8, 8)
    y = x.clone()
    torch.manual_seed(0)
    out = scopedckpt.Dropout(0.5, inplace=True)(y)
    torch.manual_seed(0)
    expected = scopedckpt.Dropout(0.5)(x)
    assert out is y and torch.equal(y, expected)


def test_inplace_dropout_in_a_region_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), scopedckpt.Dropout(0.5, inplace=True), nn.Linear(6, 2))
    from scopedckpt.testing import assert_checkpoint_equivalent

    assert_checkpoint_equivalent(model, torch.randn(4, 6), targets=[model], steps=2)


def test_empty_batch_passes_through() -> None:
    """No mask for no elements: the input comes back and no seed is drawn, in a region too."""
    x = torch.empty(0, 4)
    state = torch.get_rng_state()
    assert scopedckpt.Dropout(0.5)(x) is x
    x.requires_grad_()
    regions = COUNTERS.regions
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(scopedckpt.Dropout(0.5), x)
    assert COUNTERS.regions == regions + 1  # a region, not a plain call
    out.sum().backward()
    assert out.shape == (0, 4) and torch.equal(out, x)
    assert torch.equal(x.grad, torch.zeros(0, 4))
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn, forward or backward


@pytest.mark.parametrize(("scoped", "torch_cls", "shape"), BATCH_NORMS)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_is_torch_outside_recomputes(
    scoped: type, torch_cls: type, shape: tuple[int, ...], momentum: float | None
) -> None:
    torch.manual_seed(0)
    ours = scoped(3, momentum=momentum)
    theirs = torch_cls(3, momentum=momentum)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert isinstance(ours, torch_cls)
    assert repr(ours) == repr(theirs).replace(torch_cls.__name__, scoped.__name__)
    x = torch.randn(shape)
    for _ in range(2):
        assert torch.equal(ours(x), theirs(x))
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)
    ours.eval()
    theirs.eval()
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_regions_are_exact(dtype: torch.dtype) -> None:
    from scopedckpt.testing import assert_checkpoint_equivalent

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), scopedckpt.Dropout(0.3), scopedckpt.AlphaDropout(0.2)
    ).to(dtype)
    assert_checkpoint_equivalent(model, torch.randn(4, 8, dtype=dtype), targets=[model])
    bn = nn.Sequential(nn.Conv2d(3, 3, 1), scopedckpt.BatchNorm2d(3), scopedckpt.Dropout2d(0.5)).to(
        dtype
    )
    assert_checkpoint_equivalent(bn, torch.randn(4, 3, 2, 2).to(dtype), targets=[bn], loss_fn=None)


def test_batch_norm_with_batch_size_one_raises_torchs_error() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        scopedckpt.BatchNorm1d(3)(torch.randn(1, 3))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_invalid_p_is_rejected(p: float) -> None:
    message = f"scopedckpt: Dropout expected p between 0 and 1 (the probability of zeroing an element), got p={p}. Pass e.g. p=0.1."
    with pytest.raises(ValueError, match=re.escape(message)):
        scopedckpt.Dropout(p)
    with pytest.raises(ValueError, match=re.escape(message.replace("Dropout", "dropout", 1))):
        SF.dropout(torch.ones(2), p)


def test_non_number_p_and_bad_generator_are_rejected() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape("scopedckpt: Dropout2d expected p to be a float probability, got str."),
    ):
        scopedckpt.Dropout2d("0.5")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=re.escape(
            "scopedckpt: Dropout(generator=...) must be a torch.Generator or None, got int."
        ),
    ):
        scopedckpt.Dropout(0.5, generator=3)  # type: ignore[arg-type]


def test_channel_dropout_shape_errors_and_warnings() -> None:
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "scopedckpt: dropout1d expected 2D (C, L) or 3D (N, C, L) input, but got a 4D input."
        ),
    ):
        scopedckpt.Dropout1d(0.5)(torch.ones(2, 2, 2, 2))
    with pytest.raises(
        RuntimeError, match="channel-wise dropout needs input with at least 2 dimensions"
    ):
        SF.feature_alpha_dropout(torch.ones(3), 0.5, training=True)
    with pytest.warns(UserWarning, match="assuming that channel-wise 1D dropout"):
        scopedckpt.Dropout2d(0.5)(torch.ones(2, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scopedckpt.Dropout1d(0.5)(torch.ones(2, 3)).shape == (2, 3)  # unbatched
        assert scopedckpt.Dropout3d(0.5)(torch.ones(2, 2, 2, 2)).shape == (2, 2, 2, 2)


@pytest.mark.parametrize(("scoped", "torch_cls", "shape"), DROPOUTS[:1] + BATCH_NORMS[:1])
def test_pickle_deepcopy_and_save_load_into_torch(
    scoped: type, torch_cls: type, shape: tuple
) -> None:
    layer = (
        scoped(3)
        if "Batch" in scoped.__name__
        else scoped(0.3, generator=torch.Generator().manual_seed(1))
    )
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is scoped and repr(clone) == repr(layer)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    plain = torch_cls(3) if "Batch" in scoped.__name__ else torch_cls(0.3)
    plain.load_state_dict(torch.load(buffer), strict=True)


def test_functional_dropout_replays_in_regions() -> None:
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6)

    def body(t: torch.Tensor) -> torch.Tensor:
        return SF.dropout(lin(t), 0.5) + SF.alpha_dropout(t, 0.2, training=True)

    def run(checkpointed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        lin.weight.grad = None
        xi = x.clone().requires_grad_()
        before = COUNTERS.regions, COUNTERS.recomputes
        with scopedckpt.checkpointing(enabled=checkpointed):
            scopedckpt.checkpoint(body, xi).square().sum().backward()
        made = COUNTERS.regions - before[0], COUNTERS.recomputes - before[1]
        assert made == ((1, 1) if checkpointed else (0, 0))  # replayed, not run plainly
        return torch.cat([xi.grad.flatten(), lin.weight.grad.flatten()])

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize(("scoped", "torch_cls", "shape"), DROPOUTS)
@pytest.mark.parametrize("save_mask", [True, False])
def test_dropout_gradient_is_the_derivative_of_its_forward(
    scoped: type, torch_cls: type, shape: tuple[int, ...], save_mask: bool
) -> None:
    """Exactness compares our backward with itself; gradcheck checks it is right."""
    layer = scoped(0.4, save_mask=save_mask).double()
    x = torch.randn((4, 3) + (2,) * (len(shape) - 2), dtype=torch.float64)

    def seeded(t: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)  # the same mask at every call gradcheck makes
        return layer(t)

    # The layer is linear in x for a fixed mask: finite differences are near exact.
    assert torch.autograd.gradcheck(seeded, (x.requires_grad_(),), atol=1e-8, rtol=1e-7)


# --- Seeds: one per call, from the layer's generator or torch's default one ---

_X = torch.ones(64, 64)


def test_manual_seed_chooses_the_mask() -> None:
    torch.manual_seed(1)
    a = scopedckpt.Dropout(0.5)(_X)
    torch.manual_seed(2)
    b = scopedckpt.Dropout(0.5)(_X)
    torch.manual_seed(1)
    c = scopedckpt.Dropout(0.5)(_X)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_consecutive_calls_draw_new_masks() -> None:
    torch.manual_seed(0)
    layer = scopedckpt.Dropout(0.5)
    first, second = layer(_X), layer(_X)
    third = scopedckpt.Dropout(0.5)(_X)
    assert not torch.equal(first, second)
    assert not torch.equal(second, third)
    assert not torch.equal(first, third)


def test_a_call_draws_from_the_default_generator_only_in_training() -> None:
    layer = scopedckpt.Dropout(0.5)
    state = torch.get_rng_state()
    layer(_X)
    assert not torch.equal(torch.get_rng_state(), state)
    state = torch.get_rng_state()
    layer.eval()(_X)
    scopedckpt.Dropout(0.0)(_X)
    scopedckpt.Dropout(1.0)(_X)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_layer_generator_chooses_the_mask_and_the_global_seed_does_not() -> None:
    g = torch.Generator().manual_seed(5)
    layer = scopedckpt.Dropout(0.5, generator=g)
    torch.manual_seed(0)
    a = layer(_X)
    torch.manual_seed(1)  # changes nothing: the seed comes from g
    global_state = torch.get_rng_state()
    g.manual_seed(5)
    assert torch.equal(layer(_X), a)
    assert torch.equal(torch.get_rng_state(), global_state)  # g was drawn from, not the default
    assert not torch.equal(layer(_X), a)  # g moved on
    g.manual_seed(6)
    assert not torch.equal(layer(_X), a)
    g.manual_seed(5)
    assert torch.equal(SF.dropout(_X, 0.5, generator=g), a)  # the functional form agrees


# --- Channel dropout: one mask entry per (sample, channel) ---

CHANNEL_DROPOUTS = [
    (scopedckpt.Dropout1d, (3, 64, 5)),
    (scopedckpt.Dropout1d, (64, 5)),  # unbatched (C, L)
    (scopedckpt.Dropout2d, (3, 64, 2, 3)),
    (scopedckpt.Dropout3d, (3, 64, 2, 2, 2)),
    (scopedckpt.Dropout3d, (64, 2, 2, 2)),  # unbatched (C, D, H, W)
    (scopedckpt.FeatureAlphaDropout, (3, 64, 5)),
    (scopedckpt.FeatureAlphaDropout, (3, 64, 2, 2)),
]


@pytest.mark.parametrize(("cls", "shape"), CHANNEL_DROPOUTS)
def test_channel_masks_differ_across_channels_and_are_constant_within_one(
    cls: type, shape: tuple[int, ...]
) -> None:
    """64 channels at p=0.5: one mask for all channels of a sample has chance 2**-63."""
    torch.manual_seed(0)
    out = cls(0.5)(torch.ones(shape))
    batched = shape[0] != 64  # the unbatched shapes above start with their 64 channels
    per_channel = (out if batched else out.unsqueeze(0)).flatten(2)  # (N, C, S)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2)), "a channel is not constant"
    values = per_channel[:, :, 0]  # (N, C)
    for sample in values:
        assert sample.unique().numel() == 2, "every channel of a sample got the same mask"
    if values.shape[0] > 1:
        assert not all(torch.equal(values[0], row) for row in values[1:]), "samples share a mask"


# --- Kept values: exactly torch's x * (1 / (1 - p)) ---

_KEPT_P = [0.1, 0.3, 0.5, 0.9]
_KEPT_DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# For these p a float32 1/(1-p) rounded from double is 1 ulp off torch's 1.0f/float(1-p).
_ULP_P = [0.021, 0.123]


@pytest.mark.parametrize("dtype", _KEPT_DTYPES, ids=str)
@pytest.mark.parametrize("p", _KEPT_P + _ULP_P)
# Both formulations (NOTE [ two formulations ] in _mask.py): below and above the size limit.
@pytest.mark.parametrize("numel", [_mask.NATIVE_BELOW_ELEMENTS // 2, _mask.NATIVE_BELOW_ELEMENTS])
def test_kept_values_and_their_gradient_equal_torchs_bitwise(
    p: float, dtype: torch.dtype, numel: int
) -> None:
    """The masks differ (another RNG path); where both keep an element, the bits agree."""
    torch.manual_seed(0)
    x = (torch.rand(numel, dtype=torch.float64) + 1).to(dtype)  # no zeros: kept means nonzero
    ours_in = x.clone().requires_grad_()
    theirs_in = x.clone().requires_grad_()
    ours = SF.dropout(ours_in, p)
    theirs = torch.nn.functional.dropout(theirs_in, p)
    ours.sum().backward()
    theirs.sum().backward()
    both = (ours != 0) & (theirs != 0)
    assert int(both.sum()) > 50
    assert torch.equal(ours[both], theirs[both])
    assert torch.equal(ours_in.grad[both], theirs_in.grad[both])


@pytest.mark.parametrize("dtype", _KEPT_DTYPES, ids=str)
@pytest.mark.parametrize("p", _KEPT_P)
def test_alpha_dropout_values_equal_torchs_bitwise(p: float, dtype: torch.dtype) -> None:
    """Kept values are positive here, dropped ones the constant alpha * a * (p - 1) < 0."""
    torch.manual_seed(0)
    x = (torch.rand(16384, dtype=torch.float64) + 1).to(dtype)
    ours = SF.alpha_dropout(x, p, training=True)
    theirs = torch.nn.functional.alpha_dropout(x, p, training=True)
    kept = (ours > 0) & (theirs > 0)
    assert int(kept.sum()) > 50
    assert torch.equal(ours[kept], theirs[kept])
    assert torch.equal(ours[ours <= 0].unique(), theirs[theirs <= 0].unique())


# --- The mask's bits (NOTE [ mask bits ] in _mask.py) ---


@pytest.fixture(params=["hashed", "generator"])
def bits_from(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Large CPU masks from the hash (NOTE [ hashed bits ]) or from the device's generator."""
    if request.param == "generator":
        monkeypatch.setattr(_mask, "HASHED_DEVICES", frozenset())
    return str(request.param)


@pytest.mark.parametrize("p", [1e-3, 0.1, 0.5, 0.9])
def test_masks_keep_each_element_with_probability_one_minus_p(p: float, bits_from: str) -> None:
    """Even and odd elements alike: they are the two 32-bit halves of one 64-bit word."""
    n = 1 << 20
    keep = _mask.Mask(7, p, (n,), torch.device("cpu"), False, True).keep()
    assert keep.dtype == torch.uint8 and set(keep.unique().tolist()) <= {0, 1}
    for half in (keep[0::2], keep[1::2]):
        rate = float(half.double().mean())
        sigma = (p * (1 - p) / half.numel()) ** 0.5
        assert abs(rate - (1 - p)) < 6 * sigma, (p, rate)
    # Neighbours are independent: both kept as often as (1 - p) ** 2.
    both = float((keep[0::2] & keep[1::2]).double().mean())
    assert abs(both - (1 - p) ** 2) < 6 * ((1 - p) ** 2 / (n // 2)) ** 0.5 + 1e-9


def test_masks_of_different_seeds_are_independent(bits_from: str) -> None:
    """Neighbouring seeds (and, for the hash, seeds a few gammas apart) agree on an
    element as often as two independent masks would: p**2 + (1 - p)**2."""
    n, p = 1 << 18, 0.3
    seed = (1 << 62) - 5
    gamma = _mask._GAMMA % (1 << 64)
    base = _mask.Mask(seed, p, (n,), torch.device("cpu"), False, True).keep()
    for other in (seed - 1, seed - 2, (seed + gamma) % (1 << 64), 0):
        again = _mask.Mask(other, p, (n,), torch.device("cpu"), False, True).keep()
        agree = float((base == again).double().mean())
        expected = p**2 + (1 - p) ** 2
        assert abs(agree - expected) < 6 * (expected * (1 - expected) / n) ** 0.5, other


def _splitmix64(seed: int, word: int) -> int:
    """SplitMix64's mixer on ``seed + word * gamma``, in Python integers."""
    z = (seed + word * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def _reference_keep(seed: int, p: float, element: int) -> bool:
    half = (_splitmix64(seed, element // 2) >> (32 * (element % 2))) % (1 << 32)
    return half - (1 << 32) * (half >> 31) < _mask._threshold(p)


@pytest.mark.parametrize(
    "numel",
    [
        _mask.HASHED_FROM_ELEMENTS + 1,  # odd: the last word's high half unused
        4 * _mask._HASH_CHUNK_WORDS + 3,  # three chunks, the last one short
    ],
)
def test_hashed_masks_are_splitmix64_words(numel: int) -> None:
    """NOTE [ hashed bits ]: bit for bit a pure-Python SplitMix64, which also pins
    torch's int64 arithmetic wrapping modulo 2**64 (the multiplies overflow)."""
    seed, p = (1 << 62) - 12345, 0.3
    keep = _mask.Mask(seed, p, (numel,), torch.device("cpu"), False, True).keep()
    if numel < 1 << 17:
        elements = range(numel)
    else:  # chunk boundaries and ends
        chunk = 2 * _mask._HASH_CHUNK_WORDS
        elements = sorted(
            {e % numel for k in range(4) for e in range(k * chunk - 40, k * chunk + 40)}
        )
    expected = [_reference_keep(seed, p, e) for e in elements]
    assert keep[list(elements)].bool().tolist() == expected


def test_hashed_masks_depend_on_the_seed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on the thread count, nor on how the words are split into chunks."""
    mask = _mask.Mask(11, 0.5, (3, _mask.HASHED_FROM_ELEMENTS), torch.device("cpu"), False, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mask.keep()
        torch.set_num_threads(2)
        two = mask.keep()
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(_mask, "_HASH_CHUNK_WORDS", 1000)
    assert torch.equal(one, two) and torch.equal(one, mask.keep())


def _int64_outputs(mask: _mask.Mask) -> list[tuple[str, int]]:
    """(op, element count) of every int64 tensor an op returns while ``mask.keep()`` runs."""
    outputs: list[tuple[str, int]] = []

    class Outputs(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.int64:
                outputs.append((func._schema.name, out.numel()))
            return out

    with Outputs():
        mask.keep()
    return outputs


@pytest.mark.parametrize(
    "numel",
    [_mask.HASHED_FROM_ELEMENTS, _mask.HASHED_FROM_ELEMENTS + 3, 16 * _mask._HASH_CHUNK_WORDS + 5],
)
def test_hashed_masks_hold_two_bytes_per_element_of_scratch(numel: int) -> None:
    """Two int64 buffers of a quarter of the words, at most _HASH_CHUNK_WORDS each."""
    mask = _mask.Mask(5, 0.3, (numel,), torch.device("cpu"), False, True)
    empties = ("aten::empty", "aten::empty_like", "aten::empty.memory_format")
    words = [n for op, n in _int64_outputs(mask) if op in empties]
    quarter = -(-((numel + 1) // 2) // 4)
    assert len(words) == 2 and max(words) == min(quarter, _mask._HASH_CHUNK_WORDS)
    assert 8 * sum(words) <= 2 * numel + 16


def test_mask_thresholds_are_one_minus_p_in_units_of_two_to_the_minus_32() -> None:
    for p in (1e-3, 0.1, 0.3, 0.5, 0.75):
        assert _mask._threshold(p) + 2**31 == round((1 - p) * 2**32)
    # The extremes stay inside int32: keep nearly all, or nearly none.
    assert _mask._threshold(1e-15) == 2**31 - 1
    assert _mask._threshold(1 - 1e-15) == -(2**31)
    many = (1 << 16,)
    assert bool(_mask.Mask(3, 1e-15, many, torch.device("cpu"), False, True).keep().all())
    assert not bool(_mask.Mask(3, 1 - 1e-15, many, torch.device("cpu"), False, True).keep().any())


@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (1 << 15,), (7, 1, 1)])
def test_masks_depend_on_the_seed_alone(shape: tuple[int, ...]) -> None:
    """Not on the number of threads, and odd sizes take a prefix of the same draws."""

    def keep(seed: int) -> torch.Tensor:
        return _mask.Mask(seed, 0.5, shape, torch.device("cpu"), False, True).keep()

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = keep(11)
        torch.set_num_threads(2)
        two = keep(11)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == shape and torch.equal(one, two)
    longer = _mask.Mask(11, 0.5, (math.prod(shape) + 1,), torch.device("cpu"), False, True).keep()
    assert torch.equal(one.reshape(-1), longer[: one.numel()])
    if one.numel() > 64:
        assert not torch.equal(keep(12), one)


@pytest.mark.parametrize(
    "numel",
    [
        _mask.PIECES_FROM_ELEMENTS,
        _mask.PIECES_FROM_ELEMENTS + 1,  # the second piece one element short
        _mask.PIECES_FROM_ELEMENTS + 3,
        4 * _mask.PIECES_FROM_ELEMENTS + 2,
    ],
)
def test_large_masks_draw_their_bits_in_two_pieces(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the words at once (NOTE [ mask bits ]); on CPU the second piece continues
    the first one's sequential stream, so the bits are those of one draw. (On CPU,
    large masks are hashed instead: switched off here to test the pieces.)"""
    monkeypatch.setattr(_mask, "HASHED_DEVICES", frozenset())
    mask = _mask.Mask(5, 0.3, (numel,), torch.device("cpu"), False, True)
    words = [n for _, n in _int64_outputs(mask)]
    pieces = mask.keep()
    assert words and max(words) <= (numel + 3) // 4
    monkeypatch.setattr(_mask, "PIECES_FROM_ELEMENTS", 1 << 62)
    assert torch.equal(pieces, mask.keep())


def test_the_scale_is_computed_on_the_cpu_whatever_the_default_device() -> None:
    """CUDA divides by a scalar as a multiply by its reciprocal (an ulp off for some p)."""
    expected = float(torch.ones((), device="cpu").div_(1 - 0.021))
    _mask._scale.cache_clear()
    with torch.device("meta"):
        scale = _mask.Mask(1, 0.021, (4,), torch.device("cpu"), False, True).scale(torch.float32)
    assert scale == expected


# --- The per-thread mask generator ---


def test_each_thread_gets_its_own_mask_generator() -> None:
    cpu = torch.device("cpu")
    mine = _mask._mask_generator(cpu)
    assert _mask._mask_generator(cpu) is mine
    seen: list[tuple[torch.Generator, torch.Generator]] = []

    def worker() -> None:
        seen.append((_mask._mask_generator(cpu), _mask._mask_generator(cpu)))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a1, b1), (a2, b2) = seen  # the objects are kept alive: `is` cannot see a reused id
    assert a1 is b1 and a2 is b2
    assert a1 is not mine and a2 is not mine and a1 is not a2


def test_concurrent_dropout_calls_give_the_sequential_masks() -> None:
    def masks(seed: int) -> list[torch.Tensor]:
        layer = scopedckpt.Dropout(0.5, generator=torch.Generator().manual_seed(seed))
        return [layer(_X) for _ in range(50)]

    expected = {seed: masks(seed) for seed in (1, 2)}
    results: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(2)

    def worker(seed: int) -> None:
        barrier.wait()
        results[seed] = masks(seed)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(results[seed], expected[seed]))


# --- Batch norm replays the mode of the first forward, not the current one ---


def _bn_grads(
    checkpointed: bool, cls: type, shape: tuple[int, ...], first_train: bool
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    weights = {2: nn.Linear(3, 3), 3: nn.Conv1d(3, 3, 1), 4: nn.Conv2d(3, 3, 1)}
    weights[5] = nn.Conv3d(3, 3, 1)
    model = nn.Sequential(weights[len(shape)], cls(3), nn.Tanh())
    for _ in range(2):  # make the running statistics differ from the batch ones
        model(torch.randn(shape) * 3 + 1)
    model.train(first_train)
    x = torch.randn(shape, requires_grad=True)
    before = COUNTERS.regions, COUNTERS.recomputes
    with scopedckpt.checkpointing(model, enabled=checkpointed):
        out = model(x)
    model.train(not first_train)  # switched between forward and backward
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    made = COUNTERS.regions - before[0], COUNTERS.recomputes - before[1]
    assert made == ((1, 1) if checkpointed else (0, 0))  # the recompute did run
    return [out, x.grad, *(p.grad for p in model.parameters()), *model.buffers()]


@pytest.mark.parametrize(("cls", "torch_cls", "shape"), BATCH_NORMS)
@pytest.mark.parametrize("first_train", [True, False], ids=["train_then_eval", "eval_then_train"])
def test_batch_norm_recompute_uses_the_mode_of_the_first_forward(
    cls: type, torch_cls: type, shape: tuple[int, ...], first_train: bool
) -> None:
    expected = _bn_grads(False, cls, shape, first_train)
    actual = _bn_grads(True, cls, shape, first_train)
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        assert torch.equal(a, b)


class _CallsForwardDirectly(nn.Module):
    """Runs its batch norm's ``forward`` without ``__call__``: no module hook sees that call,
    so the buffer guard does not put the layer back in its first forward's mode for the
    recompute (``_first_forward_modes`` in _guard.py), and the layer must replay it itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(3, 3), scopedckpt.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn.forward(self.linear(x)))


@pytest.mark.parametrize("first_train", [True, False], ids=["train_then_eval", "eval_then_train"])
def test_batch_norm_replays_its_first_forwards_mode_where_no_hook_sees_its_call(
    first_train: bool,
) -> None:
    def step(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _CallsForwardDirectly()
        for _ in range(2):  # make the running statistics differ from the batch ones
            model(torch.randn(8, 3) * 3 + 1)
        model.train(first_train)
        x = torch.randn(8, 3, requires_grad=True)
        with scopedckpt.checkpointing(model, enabled=checkpointed):
            out = model(x)
        model.train(not first_train)  # switched between forward and backward
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [out, x.grad, *(p.grad for p in model.parameters()), *model.buffers()]

    for a, b in zip(step(True), step(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("save_mask", "per_element"), [(True, 1), (False, 0)])
def test_scoped_dropout_keeps_one_byte_per_element_or_none(
    save_mask: bool, per_element: int
) -> None:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.randn(64, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scopedckpt.Dropout(0.3, save_mask=save_mask)(x)
    assert sum(t.untyped_storage().nbytes() for t in saved) == per_element * x.numel()


# --- Two formulations, one result (NOTE [ two formulations ] in _mask.py) ---


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: tells -0.0 from 0.0 and one NaN from another."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.77, *_ULP_P])
@pytest.mark.parametrize(("shape", "channels"), [((64, 32), False), ((8, 16, 3, 3), True)])
@pytest.mark.parametrize("inplace", [False, True])
def test_native_and_function_dropout_are_the_same_bits(
    dtype: torch.dtype,
    p: float,
    shape: tuple[int, ...],
    channels: bool,
    inplace: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain ATen ops under torch's autograd and MaskedDropout give the same output
    and gradient bits, signed zeros and infinities included."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64).mul_(1e3).to(dtype)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")], dtype=dtype)
    grad = torch.randn(shape, dtype=torch.float64).mul_(1e3).to(dtype)
    grad.view(-1)[4:6] = torch.tensor([-0.0, 0.0], dtype=dtype)
    mask_shape = shape[:2] + (1,) * (len(shape) - 2) if channels else shape
    mask = _mask.Mask(1234, p, mask_shape, x.device, False, True)

    def run(native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        start = leaf.clone() if inplace else leaf  # in place needs a non-leaf
        if native:
            out = _mask.masked_dropout(start, mask, inplace)
        else:
            out = _mask.MaskedDropout.apply(start, mask, inplace)
        (g,) = torch.autograd.grad(out, leaf, grad)
        return out.detach(), g

    monkeypatch.setattr(_mask, "NATIVE_BELOW_ELEMENTS", 1 << 30)
    out_native, grad_native = run(native=True)
    assert not isinstance(
        _mask.masked_dropout(x.clone().requires_grad_(), mask, False).grad_fn,
        _mask.MaskedDropout._backward_cls,
    )
    out_function, grad_function = run(native=False)
    assert torch.equal(_bits(out_native), _bits(out_function))
    assert torch.equal(_bits(grad_native), _bits(grad_function))


def test_large_element_wise_masks_take_the_function() -> None:
    """Outside a recompute the formulation depends on the call only."""
    small = torch.randn(_mask.NATIVE_BELOW_ELEMENTS - 1, requires_grad=True)
    large = torch.randn(_mask.NATIVE_BELOW_ELEMENTS, requires_grad=True)
    layer = scopedckpt.Dropout(0.3)
    assert "MaskedDropout" not in type(layer(small).grad_fn).__name__
    assert "MaskedDropout" in type(layer(large).grad_fn).__name__
    assert "MaskedDropout" in type(scopedckpt.Dropout(0.3, save_mask=False)(small).grad_fn).__name__


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("save", [None, "matmuls"])
@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("last", [True, False])
def test_recomputes_take_the_aten_formulation(
    last: bool, early_stop: bool, save: str | None, inplace: bool
) -> None:
    """A recompute keeps the same byte as the first forward's MaskedDropout, from the
    ATen formulation, whose mul keeps it before allocating the output: early stop ends a
    recompute whose last saved tensor it is before that output exists. Exact either way."""
    torch.manual_seed(0)
    width = 512
    layers: list[nn.Module] = [nn.Linear(width, width), scopedckpt.Dropout(0.3, inplace=inplace)]
    block = nn.Sequential(*layers, *([] if last else [nn.Linear(width, width)]))
    # Over both limits: MaskedDropout in the first forward, the mask in pieces.
    x = torch.randn(max(_mask.NATIVE_BELOW_ELEMENTS, _mask.PIECES_FROM_ELEMENTS) // width, width)
    recomputed: list[str] = []

    class Recompute(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if scopedckpt.phase() is scopedckpt.Phase.RECOMPUTE:
                recomputed.append(str(func))
            return func(*args, **(kwargs or {}))

    def step(checkpointed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(1)
        policy = scopedckpt.policies.save_matmuls if save else None
        with scopedckpt.checkpointing(enabled=checkpointed):
            y = scopedckpt.checkpoint(block, x, early_stop=early_stop, save=policy)
        if checkpointed and last:
            assert "MaskedDropout" in type(y.grad_fn).__name__  # the first forward's
        with Recompute():
            y.square().sum().backward()
        grads = [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return y.detach(), grads

    y_plain, grads_plain = step(False)
    y_ckpt, grads_ckpt = step(True)
    assert torch.equal(y_plain, y_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_ckpt))
    assert any(op.startswith("aten.lt.") for op in recomputed)  # the mask, drawn again
    assert "aten._to_copy.default" not in recomputed  # not the Function's conversion
    output = "aten.mul_.Tensor" if inplace else "aten.mul.Tensor"  # input times the mask
    assert (output in recomputed) == (not last or not early_stop)


@pytest.mark.parametrize("numel", [2048, 1 << 16])
def test_both_formulations_keep_one_byte_per_element(numel: int) -> None:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.randn(numel, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scopedckpt.Dropout(0.3)(x)
    assert sum(t.untyped_storage().nbytes() for t in saved) == numel
