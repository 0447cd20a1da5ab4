"""Explicit generators (``generator=g``) in regions: found where a region can reach them
(NOTE [ generator places ] in ``_reach.py``) and by verified first forwards, made again by
recomputes where a forward makes and keeps them (NOTE [ generator slots ] in ``_slots.py``),
stashed at every region of their site, replayed by recomputes (NOTE [ explicit
generators ] in ``_generators.py``; issue 25, hole 6)."""

from __future__ import annotations

import contextlib
import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import _generators, _sampling, _watch
from scopedckpt._light import RecomputeDivergenceError
from scopedckpt._state import DEFAULT_SCOPE, RegionCall


class Noisy(nn.Module):
    """Adds noise from its own generator; ``last``: as the region's last op, where no
    saved tensor shows it (only the generator's state would), and which the recompute
    stops before (so it must put the generator's state back)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.last = last
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last:  # after the last saved tensor: torch's early stop skips the draw
            y = self.linear(x).tanh()
            return y + torch.randn(x.shape, generator=self.generator)
        noise = torch.randn(x.shape, generator=self.generator)
        return self.linear(x + noise).tanh()


def _train(last: bool, checkpointed: bool, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Noisy(last), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []
    for _ in range(steps):
        if checkpointed:
            with scopedckpt.checkpointing(model[1], root=model):
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        loss.backward(retain_graph=True)  # two recomputes
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad  # type: ignore[operator]
                seen.append(p.grad.clone())  # type: ignore[union-attr]
                p.grad = None
        seen.append(model[1].generator.get_state())
    return seen


@pytest.mark.parametrize("last", [False, True], ids=["inside", "last"])
def test_a_region_drawing_from_its_own_generator_trains_bit_identically(last: bool) -> None:
    """Found by the first (verified) call, replayed from then on: gradients and the
    generator's state after every step are plain training's."""
    plain = _train(last, checkpointed=False)
    checkpointed = _train(last, checkpointed=True)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


# Generators Gated blocks reach, each its own way: a script's module-level generator, one
# a helper function reads, one in a helper module (``noise_helpers.GENERATOR``).
GLOBAL_GENERATOR = torch.Generator()
HELPER_GENERATOR = torch.Generator()
NOISE = types.ModuleType("noise_helpers")
NOISE.GENERATOR = torch.Generator()  # type: ignore[attr-defined]


def _helper_draw(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=HELPER_GENERATOR)


class Sampler:
    """A plain object holding a generator."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)


class Gated(nn.Module):
    """Draws from a generator only once ``noisy`` is set, which the training loop does
    after the first step (a branch the site's first, verified call never takes): from the
    one it is given, else from the one its subclass reaches (:meth:`draw`), each in its
    own code, so that each reaches only its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.noisy = False

    def draw(self, shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError

    def generator_now(self) -> torch.Generator:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if not self.noisy:
            noise = torch.zeros_like(x)
        elif generator is not None:
            noise = torch.randn(x.shape, generator=generator)
        else:
            noise = self.draw(x.shape)
        return self.linear(x + noise).tanh()


class Attribute(Gated):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(7)

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator)

    def generator_now(self) -> torch.Generator:
        return self.generator


class Global(Gated):
    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=GLOBAL_GENERATOR)

    def generator_now(self) -> torch.Generator:
        return GLOBAL_GENERATOR


class Listed(Gated):
    def __init__(self) -> None:
        super().__init__()
        self.generators = [torch.Generator().manual_seed(7)]

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.generators[0])

    def generator_now(self) -> torch.Generator:
        return self.generators[0]


class Keyed(Gated):
    def __init__(self) -> None:
        super().__init__()
        self.generators = {"noise": torch.Generator().manual_seed(7)}

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.generators["noise"])

    def generator_now(self) -> torch.Generator:
        return self.generators["noise"]


class Held(Gated):
    def __init__(self) -> None:
        super().__init__()
        self.sampler = Sampler()

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.sampler.generator)

    def generator_now(self) -> torch.Generator:
        return self.sampler.generator


class Bound(Gated):
    """Draws through a partial it holds (``functools.partial(torch.randn, generator=g)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.randn = functools.partial(torch.randn, generator=torch.Generator().manual_seed(7))

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return self.randn(shape)

    def generator_now(self) -> torch.Generator:
        return self.randn.keywords["generator"]


class Helper(Gated):
    def draw(self, shape: torch.Size) -> torch.Tensor:
        return _helper_draw(shape)

    def generator_now(self) -> torch.Generator:
        return HELPER_GENERATOR


class InModule(Gated):
    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=NOISE.GENERATOR)

    def generator_now(self) -> torch.Generator:
        return NOISE.GENERATOR  # type: ignore[no-any-return]


class ClassAttribute(Gated):
    GENERATOR = torch.Generator()

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.GENERATOR)

    def generator_now(self) -> torch.Generator:
        return self.GENERATOR


def _noise_hook(generator: torch.Generator) -> Callable[..., torch.Tensor | None]:
    """A forward hook adding noise from ``generator`` to a noisy Gated block's output."""

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(module, Gated) or not module.noisy:
            return None
        return output + torch.randn(output.shape, generator=generator)

    return hook


def _hook_generator(hook: Callable[..., object]) -> torch.Generator:
    (cell,) = hook.__closure__  # type: ignore[attr-defined]
    return cell.cell_contents  # type: ignore[no-any-return]


class Hooked(Gated):
    """Draws in a forward hook of its own, a closure over the generator."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_hook(_noise_hook(torch.Generator().manual_seed(7)))

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.zeros(shape)

    def generator_now(self) -> torch.Generator:
        return _hook_generator(next(iter(self._forward_hooks.values())))


class GloballyHooked(Gated):
    """Draws in a global forward hook (registered by the training loop, GLOBAL_HOOK)."""

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.zeros(shape)

    def generator_now(self) -> torch.Generator:
        # the registered hook, not GLOBAL_HOOK by name: code the block's class runs reads
        # no name that leads to the generator
        (hook,) = torch.nn.modules.module._global_forward_hooks.values()
        return _hook_generator(hook)


GLOBAL_HOOK = _noise_hook(torch.Generator())


class Late(Gated):
    """Makes its generator at its first draw and keeps it in a list that was empty: its
    code names ``Generator``, so the list's first element is a place."""

    def __init__(self) -> None:
        super().__init__()
        self.generators: list[torch.Generator] = []

    def draw(self, shape: torch.Size) -> torch.Tensor:
        if not self.generators:
            self.generators.append(torch.Generator().manual_seed(7))
        return torch.randn(shape, generator=self.generators[0])

    def generator_now(self) -> torch.Generator:
        return self.generators[0] if self.generators else torch.Generator()  # none yet


class Lazy(Gated):
    """Makes its generator at its first draw, in an attribute that held None."""

    def __init__(self) -> None:
        super().__init__()
        self.generator: torch.Generator | None = None

    def draw(self, shape: torch.Size) -> torch.Tensor:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(7)
        return torch.randn(shape, generator=self.generator)

    def generator_now(self) -> torch.Generator:
        return self.generator if self.generator is not None else torch.Generator()  # none yet


def _new_generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


class MadeElsewhere(Gated):
    """Has a helper make its generator at its first draw, and keeps it in an attribute it
    did not have before: its own code does not name ``Generator``, and no place held one."""

    def draw(self, shape: torch.Size) -> torch.Tensor:
        if "generator" not in vars(self):
            self.generator = _new_generator()
        return torch.randn(shape, generator=self.generator)

    def generator_now(self) -> torch.Generator:
        made = vars(self).get("generator")
        return made if made is not None else torch.Generator()  # none yet


class Remade(MadeElsewhere):
    """Is given a new generator at every step by the training loop (:meth:`step_begins`),
    in the attribute where a helper put its first: a place no listing holds."""

    def step_begins(self) -> None:
        if "generator" in vars(self):
            self.generator = _new_generator()


# How a block reaches its generator; argument, closure and partial: a function region
# handed it (by an Attribute block, which holds another).
KINDS: dict[str, type[Gated]] = {
    "attribute": Attribute,
    "global": Global,
    "list": Listed,
    "dict": Keyed,
    "object": Held,
    "partial attribute": Bound,
    "helper": Helper,
    "helper module": InModule,
    "class attribute": ClassAttribute,
    "hook": Hooked,
    "global hook": GloballyHooked,
    "late": Late,
    "lazy": Lazy,
    "made elsewhere": MadeElsewhere,
    "remade": Remade,
    "argument": Attribute,
    "closure": Attribute,
    "partial": Attribute,
    "argument, none held": MadeElsewhere,  # its only generator the one it is given
}
GIVEN = ("argument", "closure", "partial", "argument, none held")


def _reseed() -> None:
    for generator in (
        GLOBAL_GENERATOR,
        HELPER_GENERATOR,
        NOISE.GENERATOR,
        ClassAttribute.GENERATOR,
        _hook_generator(GLOBAL_HOOK),
    ):
        generator.manual_seed(11)


def _train_gated(
    reach: str, checkpointed: bool, steps: int = 4, first_noisy: int = 1, called: bool = False
) -> list[torch.Tensor]:
    """Gradients and the generator's state after each step, the block a region reached as
    ``reach`` says: by its module target (``called``: ``checkpoint(block, x)`` instead),
    or as a region given the generator as an argument, in a closure, or in a partial."""
    if reach == "global hook":
        with _global_hook():
            return _train_gated("global hook, registered", checkpointed, steps, first_noisy, called)
    reach = reach.removesuffix(", registered")
    torch.manual_seed(0)
    _reseed()
    block = KINDS[reach]()
    given = torch.Generator().manual_seed(7) if reach in GIVEN else None
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []

    def region(inputs: torch.Tensor) -> torch.Tensor:
        if reach in ("argument", "argument, none held"):
            return scopedckpt.checkpoint(block, inputs, given)
        if reach == "closure":
            return scopedckpt.checkpoint(lambda t: block(t, given), inputs)
        if reach == "partial":
            return scopedckpt.checkpoint(functools.partial(block.forward, generator=given), inputs)
        return block(inputs)

    for step in range(steps):
        block.noisy = step >= first_noisy
        if isinstance(block, Remade):
            block.step_begins()
        if checkpointed and reach in GIVEN:
            with scopedckpt.checkpointing():
                loss = head(region(x)).sum()
        elif checkpointed and called:
            with scopedckpt.checkpointing():
                loss = head(scopedckpt.checkpoint(block, x)).sum()
        elif checkpointed:
            with scopedckpt.checkpointing(block):
                loss = head(block(x)).sum()
        else:
            loss = head(block(x, given)).sum()
        loss.backward()
        for p in [*block.parameters(), *head.parameters()]:
            seen.append(p.grad.clone())  # type: ignore[union-attr]
            p.grad = None
        seen.append((given or block.generator_now()).get_state())
    return seen


REACHES = [reach for reach in KINDS if reach not in ("made elsewhere", "remade")]


@pytest.fixture
def places_alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No code counts as naming generators (NOTE [ watched code ]): only the places a
    region reaches, and verified calls' watch, find its generators."""
    from scopedckpt import _reach

    monkeypatch.setattr(_reach, "names_generators", lambda code: False)
    _generators._Code.places.clear()
    yield
    _generators._Code.places.clear()


@pytest.fixture
def watch_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No generator is stashed when a region starts: only the watch of first forwards
    finds them."""
    monkeypatch.setattr(_generators, "_add", lambda found, generator: None)


@pytest.mark.usefixtures("places_alone")
@pytest.mark.parametrize("reach", REACHES)
def test_a_generator_first_used_on_an_unverified_call_is_replayed(reach: str) -> None:
    """A generator the region can reach is stashed at every region, verified or not: a
    draw the site's first (verified) call never made is replayed from its first use."""
    plain = _train_gated(reach, checkpointed=False)
    checkpointed = _train_gated(reach, checkpointed=True)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.usefixtures("no_sampling", "places_alone")
@pytest.mark.parametrize("reach", REACHES)
def test_a_reachable_generator_is_replayed_without_verification(reach: str) -> None:
    plain = _train_gated(reach, checkpointed=False)
    checkpointed = _train_gated(reach, checkpointed=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.usefixtures("no_sampling", "watch_alone")
@pytest.mark.parametrize("reach", list(KINDS))
def test_the_watch_of_code_that_names_generators_alone_replays_each_reach(reach: str) -> None:
    """With nothing stashed when a region starts, the watch of every first forward of a
    region whose code names generators (each block's does; a function region's through
    the modules it closes over) stashes each at its first use."""
    plain = _train_gated(reach, checkpointed=False)
    checkpointed = _train_gated(reach, checkpointed=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.parametrize("sampling", [True, False], ids=["sampled", "unverified"])
def test_a_generator_put_where_none_was_is_replayed_by_the_watch_of_its_code(
    sampling: bool,
) -> None:
    """A generator a helper makes, kept in an attribute the block did not have when its
    subtree was listed: no place holds it, but the block's code names it, so every
    first forward is watched and stashes it at its first use."""
    previous = scopedckpt.set_verification_sampling(64 if sampling else 0)
    try:
        plain = _train_gated("made elsewhere", False)
        checkpointed = _train_gated("made elsewhere", True)
    finally:
        scopedckpt.set_verification_sampling(previous)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_names_generators_reads_keywords_parameters_attributes_and_the_class() -> None:
    from scopedckpt._reach import names_generators

    def keyword(x: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=rng)

    def parameter(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return torch.nn.init.uniform_(x, 0.0, 1.0, generator)  # passed on positionally

    def attribute(module: nn.Module) -> object:
        return module.generator

    def maker() -> object:
        return torch.Generator()

    def plain(x: torch.Tensor, rng: object) -> torch.Tensor:
        return torch.randn(x.shape) + x.sum(dim=0, keepdim=True)

    for names in (keyword, parameter, attribute, maker):
        assert names_generators(names.__code__), names.__name__
    assert not names_generators(plain.__code__)


@pytest.mark.usefixtures("places_alone")
def test_a_generator_put_where_none_was_is_named_by_the_light_check_on_its_first_use() -> None:
    """The limit of places alone (NOTE [ generator places ]): a generator a helper makes,
    kept in an attribute the block did not have when its subtree was listed, is not
    looked for, so without the watch of code that names it its first use on an
    unverified call is not replayed; the light check (NOTE [ light check ]) names the
    region on that call."""
    with pytest.raises(RecomputeDivergenceError, match="MadeElsewhere"):
        _train_gated("made elsewhere", True)


@pytest.mark.usefixtures("places_alone")
@pytest.mark.parametrize("called", [False, True], ids=["target", "called"])
def test_a_generator_found_by_a_verified_call_is_replayed_at_the_sites_later_calls(
    called: bool,
) -> None:
    """One the region cannot reach without running, used at every call: the first call
    (verified) finds it, the later ones (not verified) stash it; a region that calls the
    block itself as well as one over its module target."""
    plain = _train_gated("made elsewhere", checkpointed=False, first_noisy=0)
    checkpointed = _train_gated("made elsewhere", checkpointed=True, first_noisy=0, called=called)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.fixture
def every_second_call() -> Iterator[None]:
    """Sampled verification of every second call of a site: calls 1, 3, 5, ..."""
    previous = scopedckpt.set_verification_sampling(2)
    yield
    scopedckpt.set_verification_sampling(previous)


@pytest.mark.usefixtures("places_alone", "every_second_call")
def test_a_generator_first_used_unwatched_is_refused_on_that_call() -> None:
    """First used on the second call, which nothing watched (its recompute drew other
    numbers): the light check (NOTE [ light check ]) refuses it there, named, before the
    site's next sampled call could."""
    assert not _sampling.sampled(1, 2)  # the second call is not verified
    with pytest.raises(RecomputeDivergenceError) as raised:
        _train_gated("made elsewhere", checkpointed=True, first_noisy=1)
    assert "MadeElsewhere" in str(raised.value)


class AddsNoiseLast(MadeElsewhere):
    """Adds its noise after the last op that saves a tensor: no saved tensor depends on
    it, so the light check cannot see a recompute that draws other numbers (the gradients
    stay exact; the generator runs ahead)."""

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        y = self.linear(x).tanh()
        return y + 0.1 * self.draw(x.shape) if self.noisy else y


@pytest.mark.usefixtures("places_alone", "every_second_call")
def test_unwatched_draws_no_saved_tensor_shows_are_refused_at_the_next_sampled_call() -> None:
    """NOTE [ watched sites ]: first used on the second call, unwatched, where nothing
    saved depends on it (so the light check passes, but the recompute drew again and the
    generator ran ahead); the third call, verified, finds it drawn since it was seeded and
    refuses the region, named, with the fix."""
    block, head = AddsNoiseLast(), nn.Linear(4, 1)
    x = torch.randn(3, 4)
    assert [_sampling.sampled(n, 2) for n in range(3)] == [True, False, True]
    for step in range(3):
        block.noisy = step >= 1
        with scopedckpt.checkpointing(block):
            if step < 2:
                head(block(x)).sum().backward()
                continue
            with pytest.raises(scopedckpt.ScopedCkptError, match="AddsNoiseLast") as raised:
                block(x)
    assert "has drawn since it was seeded" in str(raised.value)


@pytest.mark.usefixtures("places_alone", "every_second_call")
def test_a_generator_made_for_a_sampled_call_is_replayed_from_then_on_with_a_warning() -> None:
    """First used on the third call (verified), freshly seeded: made for it, or reseeded
    for it after drawing on the unwatched calls before; it is stashed, the site's later
    calls are watched, and the warning says what may have gone before."""
    plain = _train_gated("made elsewhere", checkpointed=False, steps=6, first_noisy=2)
    with pytest.warns(UserWarning, match="freshly seeded") as warned:
        checkpointed = _train_gated("made elsewhere", checkpointed=True, steps=6, first_noisy=2)
    assert len(warned) == 1  # the site is watched from then on
    assert "MadeElsewhere" in str(warned[0].message)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.usefixtures("places_alone", "every_second_call")
def test_a_generator_reseeded_after_unwatched_draws_is_refused_on_that_call() -> None:
    """The training loop puts a freshly seeded generator in place at every step; the second
    call (unwatched) draws from one, and its recompute draws other numbers: the light
    check refuses the step, where the third (verified) call could only have warned."""
    with pytest.raises(RecomputeDivergenceError, match="Remade"):
        _train_gated("remade", checkpointed=True, steps=3, first_noisy=1)


@pytest.mark.usefixtures("places_alone")
def test_a_new_generator_where_a_sites_first_was_is_replayed_at_its_first_use() -> None:
    """NOTE [ watched sites ]: the first call (verified) finds the block's generator; the
    training loop puts a new one in its place at every step, which no listing holds and
    no verified call sees: the site's first forwards are watched from then on."""
    plain = _train_gated("remade", checkpointed=False, steps=5, first_noisy=0)
    checkpointed = _train_gated("remade", checkpointed=True, steps=5, first_noisy=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@contextlib.contextmanager
def _global_hook() -> Iterator[None]:
    handle = torch.nn.modules.module.register_module_forward_hook(GLOBAL_HOOK)
    try:
        yield
    finally:
        handle.remove()


def _module_call(module: nn.Module, *args: object) -> RegionCall:
    return RegionCall(
        module, module, DEFAULT_SCOPE, args, {}, True, None, "default", module, module
    )


@pytest.mark.parametrize("reach", [r for r in REACHES if r not in (*GIVEN, "late", "lazy")])
def test_a_region_reaches_its_blocks_generator_and_no_other(reach: str) -> None:
    block = KINDS[reach]()
    with _global_hook() if reach == "global hook" else contextlib.nullcontext():
        assert _generators.reachable(_module_call(block)) == [block.generator_now()]


@pytest.mark.parametrize("reach", ["late", "lazy"])
def test_a_generator_a_forward_makes_is_found_where_it_keeps_it(reach: str) -> None:
    """A block whose code names Generator: its None attributes and empty lists are
    places, empty until its forward makes the generator."""
    block = KINDS[reach]()
    assert _generators.reachable(_module_call(block)) == []
    block.noisy = True
    block(torch.randn(3, 4))
    assert _generators.reachable(_module_call(block)) == [block.generator_now()]


def _function_call(fn: object) -> RegionCall:
    return RegionCall(None, fn, DEFAULT_SCOPE, (), {}, True, None, "default", None, fn)


def test_a_function_region_reaches_the_globals_it_reads_and_the_modules_it_closes_over() -> None:
    def reads_a_global(t: torch.Tensor) -> torch.Tensor:
        return t + torch.randn(t.shape, generator=GLOBAL_GENERATOR)

    def calls_a_helper(t: torch.Tensor) -> torch.Tensor:
        return t + _helper_draw(t.shape)

    def reads_a_helper_module(t: torch.Tensor) -> torch.Tensor:
        return t + torch.randn(t.shape, generator=NOISE.GENERATOR)

    block = Attribute()
    over_a_module = lambda t: block(t)  # noqa: E731
    assert _generators.reachable(_function_call(reads_a_global)) == [GLOBAL_GENERATOR]
    assert _generators.reachable(_function_call(calls_a_helper)) == [HELPER_GENERATOR]
    assert _generators.reachable(_function_call(reads_a_helper_module)) == [NOISE.GENERATOR]
    assert _generators.reachable(_function_call(over_a_module)) == [block.generator]
    partial = functools.partial(Attribute.forward, block)
    assert _generators.reachable(_function_call(partial)) == [block.generator]
    listed = [torch.Generator()]
    assert (
        _generators.reachable(
            _function_call(
                lambda t: t,
            )
        )
        == []
    )
    call = RegionCall(
        None,
        reads_a_global,
        DEFAULT_SCOPE,
        (listed,),
        {},
        True,
        None,
        "default",
        None,
        reads_a_global,
    )
    assert _generators.reachable(call) == [listed[0], GLOBAL_GENERATOR]


def test_a_region_reaches_the_globals_its_submodules_forwards_read() -> None:
    outer = nn.Sequential(Global())
    assert _generators.reachable(_module_call(outer)) == [GLOBAL_GENERATOR]


def test_reachable_finds_each_generator_once_and_never_a_default_one() -> None:
    block = Attribute()
    mine = block.generator
    call = RegionCall(
        block,
        block,
        DEFAULT_SCOPE,
        (mine, torch.default_generator),
        {"g": mine},
        True,
        None,
        "default",
        block,
        block,
    )
    assert _generators.reachable(call) == [mine]


@pytest.mark.usefixtures("no_sampling")
@pytest.mark.parametrize("reach", ["attribute", "list"])
def test_a_generator_reassigned_after_listing_is_the_one_stashed(reach: str) -> None:
    """Places are followed at every region, not remembered: a new generator object
    under the same name, or at the same index, is the one replayed."""
    torch.manual_seed(0)
    block = KINDS[reach]()
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(block):
        head(block(x)).sum().backward()
    if reach == "attribute":
        block.generator = torch.Generator().manual_seed(7)
    else:
        block.generators[0] = torch.Generator().manual_seed(7)
    block.noisy = True
    for _ in range(3):
        with scopedckpt.checkpointing(block):
            head(block(x)).sum().backward()
    # the generator advanced once per step, as in plain training from the same state
    reference = torch.Generator().manual_seed(7)
    for _ in range(3):
        torch.randn((3, 4), generator=reference)
    assert torch.equal(block.generator_now().get_state(), reference.get_state())


def _noise(block: Gated, generator: torch.Generator) -> Callable[[torch.Size], torch.Tensor]:
    return lambda shape: torch.randn(shape, generator=generator) * block.noisy


def test_a_listing_holds_the_places_it_searched_weakly() -> None:
    """A subtree's generator places start from its modules, classes and functions held
    weakly: a block that holds a generator (in a closure it keeps, too) goes when dropped."""
    block = Held()
    generator = torch.Generator()
    block.noise = _noise(block, generator)  # a closure over the block and a generator
    assert _generators.reachable(_module_call(block)) == [block.sampler.generator, generator]
    gone = weakref.ref(block)
    del block
    gc.collect()
    assert gone() is None


def test_a_generator_found_once_is_stashed_by_the_sites_later_calls() -> None:
    """One the region cannot reach without running (made in the forward) is found by the
    verified first call's watch and remembered for the site."""
    block = MadeElsewhere()
    block.noisy = True
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(block):
        block(x).sum().backward()
    found = _sampling.known_site(block, None)
    assert found is not None
    (ref,) = found.generators
    assert ref() is block.generator_now()


class Shared(nn.Module):
    """A scoped dropout and an unscoped op drawing from one generator, the module's."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)
        self.drop = scopedckpt.Dropout(0.5, generator=self.generator)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.linear(x))
        return (y * torch.rand(y.shape, generator=self.generator)).tanh()


def _train_shared(checkpointed: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []
    for _ in range(3):
        with scopedckpt.checkpointing(model, enabled=checkpointed):
            loss = model(x).sum()
        loss.backward(retain_graph=True)  # two recomputes
        loss.backward()
        for p in model.parameters():
            seen.append(p.grad.clone())  # type: ignore[union-attr]
            p.grad = None
        seen.append(model.generator.get_state())
    return seen


@pytest.mark.parametrize("sampling", [True, False], ids=["sampled", "unverified"])
def test_a_generator_a_scoped_layer_shares_with_an_unscoped_op_is_replayed(
    sampling: bool,
) -> None:
    """The replay rewinds the generator, so the scoped layer draws its seed again in the
    recompute and the unscoped op draws what it drew in the first forward (NOTE
    [ aligned draws ] in _dropout.py)."""
    previous = scopedckpt.set_verification_sampling(64 if sampling else 0)
    try:
        plain, checkpointed = _train_shared(False), _train_shared(True)
    finally:
        scopedckpt.set_verification_sampling(previous)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_the_scoped_layers_mask_generators_are_never_stashed() -> None:
    """Their draws happen under a verified first forward's watch, but they are reseeded at
    every use: remembering them would make every later region of the site stash them."""
    model = scopedckpt.convert(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)))
    x = torch.randn(8, 4)
    for _ in range(2):
        with scopedckpt.checkpointing(model):
            model(x).sum().backward()
    assert not _watch.Sites.any_found


def test_the_code_of_other_libraries_is_not_followed() -> None:
    """torch's, the standard library's and installed packages' code is large and holds no
    user generator (NOTE [ generator places ]): a search follows only the rest."""
    from scopedckpt import _reach

    assert _reach.foreign(nn.Linear) and _reach.foreign(functools.reduce)
    assert _reach.foreign(pytest.raises)  # an installed package
    assert not _reach.foreign(Attribute) and not _reach.foreign(_helper_draw)
    assert not _reach.foreign(NOISE)


def test_a_search_through_deep_code_stays_within_the_stack() -> None:
    """Helpers calling helpers 3,000 deep, the last reading a generator: the search stops
    following code before Python's recursion limit (and so misses that one)."""
    from scopedckpt import _reach

    namespace: dict[str, object] = {"__name__": "chain", "G": torch.Generator()}
    source = "".join(f"def f{i}(x):\n    return f{i + 1}(x)\n" for i in range(3000))
    exec(compile(source + "def f3000(x):\n    return G\n", "<chain>", "exec"), namespace)
    block = Attribute()
    block.first = namespace["f0"]
    places, _ = _reach.subtree_places([block])
    assert places == ((weakref.ref(block), ((0, "generator"),)),)


class Awkward:
    """An object whose every attribute lookup fails, and a dict that raises on ``items()``:
    a search looks into them, and a region follows places through them, without running
    either."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __getattribute__(self, name: str) -> object:
        raise AttributeError(name)


class AwkwardDict(dict):  # type: ignore[type-arg]
    def items(self):  # type: ignore[no-untyped-def,override]
        raise RuntimeError("items")


def test_a_search_runs_no_code_of_the_objects_it_looks_into() -> None:
    block = Attribute()
    held = torch.Generator()
    block.awkward = Awkward(held)
    block.by_name = AwkwardDict(noise=torch.Generator())
    found = _generators.reachable(_module_call(block))
    assert found == [block.generator, held, block.by_name["noise"]]


class Outer(nn.Module):
    """A region around a Lazy block and a draw of its own from the block's generator,
    after the block's (nested regions: ``nested``)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Lazy()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        if self.block.generator is not None:
            y = y + torch.randn(y.shape, generator=self.block.generator)
        return self.linear(y).tanh()


def _train_made_in_forward(checkpointed: bool, nested: bool) -> list[torch.Tensor]:
    """Gradients, the generator's state and whether the block still holds the generator
    its first forward made, each step; two backward passes per step (two recomputes)."""
    torch.manual_seed(0)
    model = Outer()
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []
    made: torch.Generator | None = None
    for step in range(4):
        model.block.noisy = step >= 1
        targets = (model, model.block) if nested else (model,)
        with scopedckpt.checkpointing(*targets, enabled=checkpointed):
            loss = model(x).sum()
        if made is None:
            made = model.block.generator
        loss.backward(retain_graph=True)
        loss.backward()
        for p in model.parameters():
            seen.append(p.grad.clone())  # type: ignore[union-attr]
            p.grad = None
        seen.append(model.block.generator_now().get_state())
        seen.append(torch.tensor(made is None or model.block.generator is made))
    return seen


@pytest.mark.usefixtures("no_sampling")
@pytest.mark.parametrize("nested", [False, True], ids=["one region", "nested"])
def test_a_generator_a_forward_makes_is_made_again_by_every_recompute(nested: bool) -> None:
    """A recompute empties the slot its first forward filled, so the forward makes the
    generator again and draws what the first forward drew; then the first forward's
    generator goes back (NOTE [ generator places ])."""
    plain = _train_made_in_forward(False, nested)
    checkpointed = _train_made_in_forward(True, nested)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
