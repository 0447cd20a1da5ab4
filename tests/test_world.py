"""The forward's world (NOTE [ forward's world ] in ``_world.py``) and the light check
(NOTE [ light check ] in ``_light.py``): regimes where the recompute would otherwise see
another world than its first forward, each trained bit for bit against plain training
over several optimizer steps, or refused on the call where it goes wrong."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrizations, parametrize

import scopedckpt
from scopedckpt.core import _sampling, _torch_private, _transforms
from scopedckpt.core._light import RecomputeDivergenceError
from scopedckpt.mechanisms import _verify
from scopedckpt.planner import _live

from .strategies import ProgramModel, Region, WarmUp

STEPS = 6


@pytest.fixture
def every_64() -> Iterator[None]:
    previous = scopedckpt.set_verification_sampling(64)  # the default, counts started over
    yield
    scopedckpt.set_verification_sampling(previous)


def _blocks(n: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n)])


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _maml(model: nn.Sequential, checkpointed: bool, second_order: bool) -> list[torch.Tensor]:
    """MAML-style fast weights: an inner step's loss, then the loss of fast weights put in
    by torch.func.functional_call, which puts the model's own back before backward."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        scope = scopedckpt.checkpointing(*model) if checkpointed else torch.enable_grad()
        with scope:
            inner = model(x).pow(2).sum()
            grads = torch.autograd.grad(inner, list(model.parameters()), create_graph=second_order)
            fast = {k: v - 0.1 * g for (k, v), g in zip(model.named_parameters(), grads)}
            outer = functional_call(model, fast, (x,)).pow(2).sum()
        optimizer.zero_grad()
        outer.backward()
        optimizer.step()
    return _parameters(model)


@pytest.mark.usefixtures("every_64")
@pytest.mark.parametrize("second_order", [True, False])
def test_functional_call_fast_weights_train_bit_identically(second_order: bool) -> None:
    plain = _maml(_blocks(), False, second_order)
    assert _equal(_maml(_blocks(), True, second_order), plain)


class Counts(nn.Module):
    """Counts its calls in a Python attribute and scales by the count."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.calls


class LayerDrop(nn.Module):
    """Skips its layer when Python's random says so (LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if random.random() < 0.5:
            return x
        return torch.tanh(self.linear(x)) + x


class LockedDropout(nn.Module):
    """A variational dropout mask made at the first call of a step and cached on the
    module until the step's end (``reset``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            self.mask = (torch.rand(x.shape) > 0.3).float()
        return torch.tanh(self.linear(x)) * self.mask

    def reset(self) -> None:
        self.mask = None


class PassesByAttribute(nn.Module):
    """A tensor passed between its two layers through an attribute; a second view's
    forward before backward overwrites it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = torch.tanh(self.first(x))
        return self.second(self._read())

    def _read(self) -> torch.Tensor:
        assert self.cache is not None
        return self.cache * 2


class SizesAtFirstCall(nn.Module):
    """An observer that sizes its per-channel buffer at its first call (as QAT's
    fake-quantize observers do) and keeps a running maximum in it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("max_val", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        with torch.no_grad():
            seen = y.abs().amax(0)
            if self.max_val.numel() == 0:
                self.max_val = seen.clone()
            else:
                self.max_val = torch.maximum(self.max_val, seen)
        return y / self.max_val.clamp_min(1e-3)


class GainsAnAttribute(nn.Module):
    """Has no attribute of its own until its first forward makes one, then counts in it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in vars(self):
            self.scale = 1.0
        else:
            self.scale += 0.5
        return torch.tanh(self.linear(x) * self.scale)


def _train(
    make: Callable[[], nn.Module],
    checkpointed: bool,
    views: int = 1,
    step_end: Callable[[nn.Module], None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    torch.manual_seed(0)
    random.seed(0)
    model = nn.Sequential(make(), make(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(5, 4, generator=data)
        scope = scopedckpt.checkpointing(model[0], model[1]) if checkpointed else nullcontext()
        loss = torch.zeros(())
        with torch.enable_grad(), scope:
            for view in range(views):
                loss = loss + model(x + view).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step_end is not None:
            for module in model[:2]:
                step_end(module)
    state = [b.detach().clone() for b in model.buffers()]
    return _parameters(model), state, random.random()


REGIMES: dict[str, tuple[Callable[[], nn.Module], int, Callable[[nn.Module], None] | None]] = {
    "counter attribute": (Counts, 1, None),
    "python random control flow": (LayerDrop, 1, None),
    "locked dropout mask cached on the module": (LockedDropout, 2, LockedDropout.reset),
    "tensor passed by attribute, second view": (PassesByAttribute, 2, None),
    "buffer sized at the first call": (SizesAtFirstCall, 1, None),
    # a child, which (unlike a region's own module, whose forward is patched) holds no
    # attribute of its own at the first region's start
    "attribute the first forward adds, in a child": (
        lambda: nn.Sequential(GainsAnAttribute()),
        1,
        None,
    ),
}


@pytest.mark.usefixtures("every_64")
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_the_recompute_runs_in_the_first_forwards_world(regime: str) -> None:
    make, views, step_end = REGIMES[regime]
    plain = _train(make, False, views, step_end)
    checkpointed = _train(make, True, views, step_end)
    assert _equal(checkpointed[0], plain[0])
    assert _equal(checkpointed[1], plain[1])  # buffers
    assert checkpointed[2] == plain[2]  # Python's random stream after training


class Symmetric(nn.Module):
    """A symmetric weight, ``W Wᵀ / n``: its matmul saves ``W``, so a recompute that reads
    the weight from ``parametrize.cached()``'s cache saves fewer tensors than one that
    computes it."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w @ w.mT / w.shape[-1]


def _symmetric(layer: nn.Linear) -> None:
    parametrize.register_parametrization(layer, "weight", Symmetric())


PARAMETRIZATIONS: dict[str, Callable[[nn.Linear], object]] = {
    "custom symmetric": _symmetric,
    "weight_norm": parametrizations.weight_norm,
    "orthogonal": parametrizations.orthogonal,
}


def _train_cached(
    parametrization: str, checkpointed: bool, backward: str, nested: bool
) -> list[torch.Tensor]:
    """Trains under ``parametrize.cached()``, its cache read outside the region too (a weight
    cached before it starts, one it caches read after it); backward ``inside`` the block,
    ``after`` it or ``only`` inside it: the losses, every step's gradients, the parameters."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(block, nn.Linear(4, 1))
    for layer in (block[0], block[2]):
        PARAMETRIZATIONS[parametrization](layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(2)
    seen: list[torch.Tensor] = []
    for _ in range(STEPS):
        x = torch.randn(5, 4, generator=data)
        regions = (block, block[0]) if nested else (block,)
        scope = scopedckpt.checkpointing(*regions) if checkpointed else nullcontext()
        with parametrize.cached() if backward != "only" else nullcontext():
            before = block[2].weight.sum()
            with torch.enable_grad(), scope:
                loss = model(x).square().mean()
            loss = loss + 0.1 * (before + block[0].weight.sum())
            cache = dict(_torch_private.parametrize_cache()[1])
            optimizer.zero_grad()
            if backward == "inside":
                loss.backward()
                now = _torch_private.parametrize_cache()[1]  # the recompute's cache is gone
                assert now.keys() == cache.keys()
                assert all(now[k] is v for k, v in cache.items())
        if backward == "only":
            with parametrize.cached():
                loss.backward()
                assert _torch_private.parametrize_cache()[1] == {}  # the recompute's too
        elif backward == "after":
            loss.backward()
        seen += [loss.detach(), *(p.grad.clone() for p in model.parameters())]  # type: ignore[union-attr]
        optimizer.step()
    assert _torch_private.parametrize_cache() == (0, {})
    return seen + _parameters(model)


@pytest.mark.usefixtures("every_64")
@pytest.mark.parametrize("nested", [False, True], ids=["one region", "nested"])
@pytest.mark.parametrize("backward", ["inside", "after", "only"])
@pytest.mark.parametrize("parametrization", sorted(PARAMETRIZATIONS))
def test_parametrize_cached_through_backward_trains_bit_identically(
    parametrization: str, backward: str, nested: bool
) -> None:
    """``parametrize.cached()`` is part of the forward's world: every recompute reads the
    cache the region started with (a weight cached inside the region is computed again,
    one cached before it is read), in the block or after it, and its own writes go."""
    plain = _train_cached(parametrization, False, backward, nested)
    checkpointed = _train_cached(parametrization, True, backward, nested)
    assert _equal(checkpointed, plain)


@pytest.mark.usefixtures("every_64")
def test_a_counter_reads_as_in_plain_training_after_the_recompute() -> None:
    """The recompute's own writes do not outlive it."""
    model = nn.Sequential(Counts(), nn.Linear(4, 1))
    for step in range(1, 4):
        with scopedckpt.checkpointing(model[0]):
            loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        assert model[0].calls == step


@pytest.mark.usefixtures("every_64")
def test_a_call_never_recomputed_teaches_its_site_what_its_forward_changed() -> None:
    """The case the thorough profile found: three regions of one site (a bound method),
    the second nesting a fourth. The first step recomputes only the third, which starts
    after the second's forward counted in ``pool[3]``; that counter is learned from the
    second's own forward, so its recompute at the second step (an unverified call, its nested
    region now saving a tensor) counts from where the first forward did, and takes its
    branch."""

    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        pool = [WarmUp(), nn.Linear(1, 1), WarmUp(), WarmUp()]
        program = (
            Region((0,), False),
            Region((3, Region((0,), False)), False),
            Region((0,), False),
        )
        model = ProgramModel(pool, program)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(STEPS):
            x = torch.tensor([[1.5410], [-0.2934]], requires_grad=True)
            with scopedckpt.checkpointing() if checkpointed else nullcontext():
                loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert (pool[0].calls, pool[3].calls) == (3 * STEPS, STEPS)
        return [x.grad, *_parameters(model)]

    assert _equal(train(True), train(False))


def test_numpy_draws_in_a_forward_are_replayed() -> None:
    numpy = pytest.importorskip("numpy")

    class NumpyNoise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            noise = torch.from_numpy(numpy.random.standard_normal(x.shape)).float()
            return torch.tanh(self.linear(x) + noise)

    def run(checkpointed: bool) -> tuple[list[torch.Tensor], float]:
        numpy.random.seed(0)
        result = _train(NumpyNoise, checkpointed)
        return result[0], float(numpy.random.random())

    plain, checkpointed = run(False), run(True)
    assert _equal(checkpointed[0], plain[0]) and checkpointed[1] == plain[1]


class WarmsUp(nn.Module):
    """Draws from Python's random only once warmed up: the draw starts on an unverified
    call, which nothing learned to replay."""

    warm = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return (y * random.random()).sin() if WarmsUp.warm else y


@pytest.mark.usefixtures("every_64")
def test_a_random_draw_that_starts_unverified_is_named_on_its_call() -> None:
    model = nn.Sequential(nn.Linear(4, 4), WarmsUp(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    try:
        for step in range(4):
            WarmsUp.warm = step >= 2
            with scopedckpt.checkpointing(model[1], root=model):
                loss = model(x).sum()
            if step < 2:
                loss.backward()
                continue
            assert not _sampling.sampled(step, 64)  # this call is not verified
            with pytest.raises(
                RecomputeDivergenceError,
                match=r"^scopedckpt: the recompute of "
                r"the forward of '1' \(WarmsUp\) did not reproduce",
            ):
                loss.backward()
            return
    finally:
        WarmsUp.warm = False


def test_a_recompute_that_takes_another_path_is_named() -> None:
    """Another number of saved tensors: a ScopedCkptError naming the region by its path,
    which torch's CheckpointError does not."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.deep = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            return y.tanh().tanh() if self.deep else y.tanh()

    model = nn.Sequential(Branches(), nn.Linear(4, 1))
    with scopedckpt.checkpointing(model[0], root=model, determinism_check="none"):
        loss = model(torch.randn(2, 4)).sum()
    model[0].deep = False  # a switch flipped between forward and backward, unseen
    with pytest.raises(RecomputeDivergenceError, match="'0' \\(Branches\\) took another path"):
        loss.backward()


def test_a_verified_call_keeps_no_more_memory_than_an_unverified_one() -> None:
    """NOTE [ bitwise verification ]: the first forward's saved tensors are held weakly,
    so a verified step peaks where an unverified one does (the planner's counter)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)]
    )
    x = torch.randn(128, 64)

    def peaks(check: str) -> tuple[int, int]:
        """The forward's peak, and the step's."""
        model.zero_grad(set_to_none=True)  # gradients made anew in each measured step
        with _live.LiveBytes() as counter:
            with scopedckpt.checkpointing(*model, determinism_check=check):
                loss = model(x).square().mean()
            forward = counter.peak
            loss.backward()
        return forward, counter.peak

    peaks("bitwise")  # the fingerprints' process-wide caches (index and weight vectors)
    before = _verify.COUNTERS.compared
    verified = peaks("bitwise")
    assert _verify.COUNTERS.compared > before
    unverified = peaks("none")
    assert verified[0] <= 1.02 * unverified[0], (verified, unverified)
    assert verified[1] <= 1.02 * unverified[1], (verified, unverified)


@pytest.mark.usefixtures("every_64")
def test_under_a_torch_func_transform_regions_run_plainly_and_exactly() -> None:
    """vmap over an ensemble's stacked weights: the recompute would run outside vmap."""
    models = [_blocks(2) for _ in range(3)]
    for i, m in enumerate(models):
        torch.manual_seed(i)
        for p in m.parameters():
            p.data.normal_()
    params, buffers = torch.func.stack_module_state(models)
    template = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(5, 4)

    def member(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(template, (p, b), (x,))

    plain = torch.vmap(member)(params, buffers).sum()
    (plain_grads,) = torch.autograd.grad(plain, [params["0.0.weight"]])
    _transforms._Said.transform = False  # said once per process
    with pytest.warns(UserWarning, match="torch.func transform"):
        with scopedckpt.checkpointing(*template):
            out = torch.vmap(member)(params, buffers).sum()
    (grads,) = torch.autograd.grad(out, [params["0.0.weight"]])
    assert torch.equal(grads, plain_grads)


def _hooked_training(checkpointed: bool) -> tuple[list[torch.Tensor], list[object]]:
    """Trains a model whose inner layers carry each kind of user hook; what the hooks saw."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
        nn.Linear(4, 1),
    )
    captured: list[torch.Tensor] = []
    by_name: dict[str, torch.Tensor] = {}
    counts = {"calls": 0}
    statistics = {"sum": 0.0}

    def capture(module: nn.Module, args: object, output: torch.Tensor) -> None:
        captured.append(output.detach().clone())

    def keep_by_name(module: nn.Module, args: object, output: torch.Tensor) -> None:
        by_name[f"{len(by_name)}"] = output.detach().clone()

    def count(module: nn.Module, args: object) -> None:
        counts["calls"] += 1

    def statistic(module: nn.Module, args: object, output: torch.Tensor) -> None:
        statistics["sum"] += float(output.detach().abs().sum())

    def replace(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output * 0.5

    def in_place(module: nn.Module, args: object, output: torch.Tensor) -> None:
        output.mul_(1.5)

    def scale_input(module: nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (args[0] * 2.0,)

    for block in model[:2]:
        block[0].register_forward_hook(in_place)  # before tanh, which saves its output
        block[0].register_forward_hook(capture)
        block[0].register_forward_hook(keep_by_name)
        block[0].register_forward_pre_hook(count)
        block[1].register_forward_hook(statistic)
        block[1].register_forward_hook(replace)
        block[2].register_forward_pre_hook(scale_input)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        scope = scopedckpt.checkpointing(model[0], model[1]) if checkpointed else nullcontext()
        with scope:
            loss = model(torch.randn(5, 4, generator=data)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seen: list[object] = [len(captured), len(by_name), counts["calls"], statistics["sum"]]
    return _parameters(model) + captured, seen


@pytest.mark.usefixtures("every_64")
def test_hooks_that_look_run_once_and_hooks_that_change_tensors_still_apply() -> None:
    """NOTE [ hooks in recomputes ]: capture (list and dict), counter and statistics hooks
    see each call once, as in plain training; output-replacing, in-place and
    input-replacing hooks apply in the recompute too, so training is exact."""
    plain, plain_seen = _hooked_training(False)
    checkpointed, checkpointed_seen = _hooked_training(True)
    assert checkpointed_seen == plain_seen
    assert _equal(checkpointed, plain)


def test_a_converted_model_runs_under_vmap_with_different_randomness() -> None:
    """Scoped dropout under a torch.func transform is torch's dropout (a seed cannot be read
    out of a batched draw): the same bits as the unconverted model."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    converted = scopedckpt.convert(copy.deepcopy(plain))
    x = torch.randn(3, 5, 4)
    outputs = []
    for model in (plain, converted):
        torch.manual_seed(1)
        outputs.append(torch.vmap(model, randomness="different")(x))
    assert torch.equal(outputs[0], outputs[1])


def test_registered_generators_are_validated() -> None:
    with pytest.raises(TypeError, match=r"item #1 is an int\.$"):
        scopedckpt.checkpointing(generators=[torch.Generator(), 3])  # type: ignore[list-item]
