"""Explicit generators (``generator=g``) in regions: those a region holds in its modules'
attributes, is given, was registered with or its site's verified calls used are replayed
bit for bit; any other is refused, named, with the fix (NOTE [ explicit generators ] in
``_generators.py``; issue 25, hole 6; issue 40)."""

from __future__ import annotations

import contextlib
import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt.core import _sampling
from scopedckpt.core._subtree import attribute_places
from scopedckpt.mechanisms import _generators


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
    reach: str,
    checkpointed: bool,
    steps: int = 6,
    first_noisy: int = 1,
    called: bool = False,
    register: bool = False,
) -> list[torch.Tensor]:
    """Gradients and the generator's state after each step, the block a region reached as
    ``reach`` says: by its module target (``called``: ``checkpoint(block, x)`` instead),
    or as a region given the generator as an argument, in a closure, or in a partial;
    ``register``: the block's generator registered with checkpointing(generators=...)."""
    if reach == "global hook":
        with _global_hook():
            return _train_gated(
                "global hook, registered", checkpointed, steps, first_noisy, called, register
            )
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
            registered = [block.generator_now()] if register else []
            with scopedckpt.checkpointing(block, generators=registered):
                loss = head(block(x)).sum()
        else:
            loss = head(block(x, given)).sum()
        loss.backward()
        for p in [*block.parameters(), *head.parameters()]:
            seen.append(p.grad.clone())  # type: ignore[union-attr]
            p.grad = None
        seen.append((given or block.generator_now()).get_state())
    return seen


@contextlib.contextmanager
def _global_hook() -> Iterator[None]:
    handle = torch.nn.modules.module.register_module_forward_hook(GLOBAL_HOOK)
    try:
        yield
    finally:
        handle.remove()


# Where a generator first used on a call that is not verified (a warm-up switch) is held
# by one of NOTE [ explicit generators ]'s four kinds: replayed. Anywhere else: refused.
REPLAYED = ("attribute", "list", "dict", *GIVEN)
# A hook adding noise to the block's output draws after the region's last saved tensor:
# torch's early stop ends the recompute before the hook, so it never draws again.
UNSEEN = ("hook", "global hook")
REFUSED = tuple(reach for reach in KINDS if reach not in (*REPLAYED, *UNSEEN))


def _same(plain: list[torch.Tensor], checkpointed: list[torch.Tensor]) -> bool:
    return len(plain) == len(checkpointed) and all(
        torch.equal(a, b) for a, b in zip(plain, checkpointed)
    )


@pytest.mark.parametrize("reach", REPLAYED)
def test_a_held_or_given_generator_switched_on_later_is_replayed(reach: str) -> None:
    """First used on the second step, which is not verified: stashed when each region
    starts, so replayed from its first use; gradients and its state after every step."""
    assert _same(_train_gated(reach, False), _train_gated(reach, True))


@pytest.mark.parametrize("reach", UNSEEN)
def test_a_generator_drawn_after_the_last_saved_tensor_is_not_drawn_again(reach: str) -> None:
    assert _same(_train_gated(reach, False), _train_gated(reach, True))


@pytest.mark.usefixtures("no_sampling")
@pytest.mark.parametrize("reach", REPLAYED)
def test_a_held_or_given_generator_is_replayed_without_verification(reach: str) -> None:
    assert _same(_train_gated(reach, False), _train_gated(reach, True))


@pytest.mark.parametrize("reach", REFUSED)
def test_a_generator_held_elsewhere_switched_on_later_is_refused(reach: str) -> None:
    """A global, a plain object's, a class attribute, a hook's closure, a partial held by
    a module, one a forward makes on an unverified call, one the loop replaces: first used
    on a call nothing watched, it is never replayed wrong silently: the light check names
    the block on that call."""
    with pytest.raises(scopedckpt.ScopedCkptError, match=KINDS[reach].__name__) as refused:
        _train_gated(reach, True)
    assert "generator" in str(refused.value)


@pytest.mark.parametrize("reach", [r for r in KINDS if r != "remade"])
def test_a_generator_used_from_the_first_call_is_replayed(reach: str) -> None:
    """The site's first call is verified: its watch stashes each generator at its first
    use and remembers it for the site, whose later calls stash it when they start."""
    plain = _train_gated(reach, False, first_noisy=0)
    assert _same(plain, _train_gated(reach, True, first_noisy=0))


def test_a_called_block_is_a_site_of_its_own() -> None:
    """checkpoint(block, x) rather than a region over the block's module target."""
    plain = _train_gated("made elsewhere", False, first_noisy=0)
    assert _same(plain, _train_gated("made elsewhere", True, first_noisy=0, called=True))


def test_a_new_generator_at_every_step_is_refused() -> None:
    """The loop puts a freshly seeded generator in the block at every step: the site's
    verified first call saw another one, so the second step's recompute draws other
    numbers from the new one, and the light check names the block."""
    with pytest.raises(scopedckpt.ScopedCkptError, match="Remade"):
        _train_gated("remade", True, first_noisy=0)


@pytest.mark.parametrize("reach", ["global", "object", "helper", "class attribute"])
def test_registering_a_generator_held_elsewhere_replays_it(reach: str) -> None:
    """The fix the refusals name: checkpointing(generators=[g])."""
    plain = _train_gated(reach, False)
    assert _same(plain, _train_gated(reach, True, register=True))


def test_the_watch_finds_a_generator_the_first_call_uses_and_remembers_it() -> None:
    block = MadeElsewhere()
    block.noisy = True
    with scopedckpt.checkpointing(block):
        block(torch.randn(3, 4)).sum().backward()
    found = _sampling.known_site(block, None)
    assert found is not None
    assert [ref() for ref in found.generators] == [block.generator_now()]


def test_the_scoped_layers_mask_generators_are_never_stashed() -> None:
    """Their draws happen under a verified first forward's watch, but they are reseeded at
    every use: remembering them would make every later region of the site stash them."""
    model = scopedckpt.convert(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)))
    x = torch.randn(8, 4)
    for _ in range(2):
        with scopedckpt.checkpointing(model):
            model(x).sum().backward()
    assert all(not site.generators for site in _sampling._Sampling.sites.values())


@pytest.mark.parametrize("reach", ["attribute", "list"])
def test_a_generator_reassigned_after_listing_is_the_one_stashed(reach: str) -> None:
    """Attributes are followed at every region, not remembered: a new generator object
    put where the old one was and first used on an unverified call is replayed."""
    block = KINDS[reach]()
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(block):
        block(x).sum().backward()  # listed, with the old generator
    new = torch.Generator().manual_seed(3)
    if reach == "attribute":
        block.generator = new
    else:
        block.generators[0] = new
    block.noisy = True
    with scopedckpt.checkpointing(block):
        y = block(x)
    after = new.get_state()
    y.sum().backward()  # the recompute draws from new again, then puts its state back
    assert torch.equal(new.get_state(), after)


def test_attribute_places_are_found_in_lists_and_dicts_and_held_weakly() -> None:
    block = Keyed()
    block.plain = [1, torch.Generator()]
    block.other = (1, 2)
    places = attribute_places([block])
    assert sorted(name for _, name in places) == ["generators", "plain"]
    gone = weakref.ref(block)
    del block
    gc.collect()
    assert gone() is None and places[0][0]() is None


class DrawsFromAGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=_NOISE[0])
        return torch.tanh(self.linear(x + noise))


_NOISE: list[torch.Generator] = []


def _train_registered(checkpointed: bool) -> list[torch.Tensor]:
    _NOISE[:] = [torch.Generator().manual_seed(5)]
    torch.manual_seed(0)
    model = nn.Sequential(DrawsFromAGlobal(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(3, 4)
    for _ in range(6):
        scope = (
            scopedckpt.checkpointing(model[0], generators=_NOISE) if checkpointed else nullcontext()
        )
        with scope:
            loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [*(p.detach().clone() for p in model.parameters()), _NOISE[0].get_state()]


def test_a_registered_generator_is_replayed_without_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """checkpointing(generators=[g]): each region stashes g and its recomputes replay it,
    with the watch of verified calls seeing nothing."""
    monkeypatch.setattr(_generators.Watch, "_found", lambda self, stash, generator: None)
    assert _same(_train_registered(False), _train_registered(True))


@pytest.fixture
def every_second_call() -> Iterator[None]:
    """Sampled verification of every second call of a site: calls 1, 3, 5, ..."""
    previous = scopedckpt.set_verification_sampling(2)
    yield
    scopedckpt.set_verification_sampling(previous)


class AddsNoiseLast(MadeElsewhere):
    """Adds its noise after the last op that saves a tensor: no saved tensor depends on
    it, so the light check cannot see a recompute that draws other numbers (the gradients
    stay exact; the generator runs ahead)."""

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        y = self.linear(x).tanh()
        return y + 0.1 * self.draw(x.shape) if self.noisy else y


@pytest.mark.usefixtures("every_second_call")
def test_unwatched_draws_no_saved_tensor_shows_are_refused_at_the_next_sampled_call() -> None:
    """NOTE [ explicit generators ]: first used on the second call, unwatched, where nothing
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


@pytest.mark.usefixtures("every_second_call")
def test_a_generator_made_for_a_sampled_call_is_replayed_from_then_on_with_a_warning() -> None:
    """First used on the third call (verified), freshly seeded: made for it, or reseeded
    for it after drawing on the unwatched calls before; it is stashed, the site remembers
    it, and the warning says what may have gone before."""
    plain = _train_gated("made elsewhere", checkpointed=False, steps=6, first_noisy=2)
    with pytest.warns(UserWarning, match="freshly seeded") as warned:
        checkpointed = _train_gated("made elsewhere", checkpointed=True, steps=6, first_noisy=2)
    assert len(warned) == 1  # remembered for the site from then on
    assert "MadeElsewhere" in str(warned[0].message)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


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
    for _ in range(4):
        model.block.noisy = True
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


@pytest.mark.parametrize("nested", [False, True], ids=["one region", "nested"])
def test_a_generator_a_forward_makes_is_made_again_by_every_recompute(nested: bool) -> None:
    """The first step's recompute runs in the forward's world, where the attribute holds
    None: the forward makes the generator again and draws what the first forward drew,
    then the first forward's generator goes back (NOTE [ forward's world ]); later steps
    stash it, as the first step's watch found it (NOTE [ explicit generators ])."""
    plain = _train_made_in_forward(False, nested)
    checkpointed = _train_made_in_forward(True, nested)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_dropout_masks_run_past_the_watch_of_verified_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verified first forward runs under the watch (NOTE [ explicit generators ]); a large
    CPU dropout mask's sixty calls draw from scopedckpt's own generators and run aside
    (``core/_own_ops.aside``), past it, while the model's calls reach it."""
    seen: list[str] = []
    watched = _generators.Watch.__torch_function__

    def counting(self: object, func: Callable[..., object], *rest: object, **kw: object) -> object:
        seen.append(getattr(func, "__name__", str(func)))
        return watched(self, func, *rest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_generators.Watch, "__torch_function__", counting)
    torch.manual_seed(0)
    model = scopedckpt.convert(nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.3)))
    x = torch.randn(128, 1024)
    with scopedckpt.checkpointing(model, determinism_check="bitwise"):
        loss = model(x).square().mean()
    loss.backward()
    assert "linear" in seen
    assert not {"bitwise_xor_", "bitwise_right_shift", "lt"} & set(seen), seen
