"""Explicit generators (``generator=g``) in regions: found by verified first forwards,
stashed at every region of their site, replayed by recomputes (NOTE [ explicit
generators ] in ``_generators.py``; issue 25, hole 6)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import _generators
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


# A module-level generator, read by Global's forward (a script's ``G = torch.Generator()``).
GLOBAL_GENERATOR = torch.Generator().manual_seed(11)


class Gated(nn.Module):
    """Draws from a generator only once ``noisy`` is set, which the training loop does
    after the first step (a branch the site's first, verified call never takes); the
    generator is reached the way ``reach`` says."""

    def __init__(self, reach: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.reach = reach
        self.noisy = False
        if reach == "attribute":
            self.generator = torch.Generator().manual_seed(7)
        elif reach == "list":  # not a place a region is looked at for generators
            self.generators = [torch.Generator().manual_seed(7)]

    def noise(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if not self.noisy:
            return torch.zeros_like(x)
        if generator is None:
            generator = {
                "attribute": lambda: self.generator,
                "global": lambda: GLOBAL_GENERATOR,
                "list": lambda: self.generators[0],
            }[self.reach]()
        return torch.randn(x.shape, generator=generator)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.linear(x + self.noise(x, generator)).tanh()


class GlobalGated(Gated):
    """Gated, whose forward reads the module-level generator by name."""

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        assert GLOBAL_GENERATOR is not None  # read here, in the forward's own code
        return super().forward(x, generator)


def _gated_generator(block: Gated, argument: torch.Generator | None) -> torch.Generator:
    if argument is not None:
        return argument
    return {
        "attribute": lambda: block.generator,
        "global": lambda: GLOBAL_GENERATOR,
        "list": lambda: block.generators[0],
    }[block.reach]()


def _train_gated(
    reach: str, checkpointed: bool, steps: int = 4, first_noisy: int = 1
) -> list[torch.Tensor]:
    """Gradients and the generator's state after each step, the block a region reached as
    ``reach`` says: by its module target, or as a function region given the generator
    as an argument, in a closure, or in a partial."""
    torch.manual_seed(0)
    GLOBAL_GENERATOR.manual_seed(11)
    kind = Gated if reach != "global" else GlobalGated
    block = kind("attribute" if reach in ("argument", "closure", "partial") else reach)
    given = (
        torch.Generator().manual_seed(7) if reach in ("argument", "closure", "partial") else None
    )
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []

    def region(inputs: torch.Tensor) -> torch.Tensor:
        if reach == "argument":
            return scopedckpt.checkpoint(block, inputs, given)
        if reach == "closure":
            return scopedckpt.checkpoint(lambda t: block(t, given), inputs)
        if reach == "partial":
            return scopedckpt.checkpoint(functools.partial(block.forward, generator=given), inputs)
        return block(inputs)

    for step in range(steps):
        block.noisy = step >= first_noisy
        if checkpointed and reach in ("argument", "closure", "partial"):
            with scopedckpt.checkpointing():
                loss = head(region(x)).sum()
        elif checkpointed:
            with scopedckpt.checkpointing(block):
                loss = head(block(x)).sum()
        else:
            loss = head(block(x, given)).sum()
        loss.backward()
        for p in [*block.parameters(), *head.parameters()]:
            seen.append(p.grad.clone())  # type: ignore[union-attr]
            p.grad = None
        seen.append(_gated_generator(block, given).get_state())
    return seen


REACHES = ["attribute", "global", "argument", "closure", "partial"]


@pytest.mark.parametrize("reach", REACHES)
def test_a_generator_first_used_on_an_unverified_call_is_replayed(reach: str) -> None:
    """A generator the region can reach is stashed at every region, verified or not: a
    draw the site's first (verified) call never made is replayed from its first use."""
    plain = _train_gated(reach, checkpointed=False)
    checkpointed = _train_gated(reach, checkpointed=True)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.usefixtures("no_sampling")
@pytest.mark.parametrize("reach", REACHES)
def test_a_reachable_generator_is_replayed_without_verification(reach: str) -> None:
    plain = _train_gated(reach, checkpointed=False)
    checkpointed = _train_gated(reach, checkpointed=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_a_generator_held_elsewhere_is_found_only_by_verified_calls() -> None:
    """The limit NOTE [ explicit generators ] states: a generator in a list attribute is
    not looked for, so a first use on an unverified call goes unseen."""
    block = Gated("list")
    call = RegionCall(block, block, DEFAULT_SCOPE, (), {}, True, None, "default", block, block)
    assert _generators.reachable(call) == []
    assert not all(
        torch.equal(a, b) for a, b in zip(_train_gated("list", False), _train_gated("list", True))
    )


def test_a_generator_found_by_a_verified_call_is_replayed_at_the_sites_later_calls() -> None:
    """One the region cannot reach without running, used at every call: the first call
    (verified) finds it, the later ones (not verified) stash it."""
    plain = _train_gated("list", checkpointed=False, first_noisy=0)
    checkpointed = _train_gated("list", checkpointed=True, first_noisy=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def _function_call(fn: object) -> RegionCall:
    return RegionCall(None, fn, DEFAULT_SCOPE, (), {}, True, None, "default", None, fn)


def test_a_function_region_reaches_the_globals_it_reads_and_the_modules_it_closes_over() -> None:
    def reads_a_global(t: torch.Tensor) -> torch.Tensor:
        return t + torch.randn(t.shape, generator=GLOBAL_GENERATOR)

    block = Gated("attribute")
    over_a_module = lambda t: block(t)  # noqa: E731
    assert _generators.reachable(_function_call(reads_a_global)) == [GLOBAL_GENERATOR]
    assert _generators.reachable(_function_call(over_a_module)) == [block.generator]
    partial = functools.partial(Gated.forward, block)
    assert _generators.reachable(_function_call(partial)) == [block.generator]


def test_a_region_reaches_the_globals_its_submodules_forwards_read() -> None:
    outer = nn.Sequential(GlobalGated("global"))
    call = RegionCall(outer, outer, DEFAULT_SCOPE, (), {}, True, None, "default", outer, outer)
    assert _generators.reachable(call) == [GLOBAL_GENERATOR]


def test_reachable_finds_each_generator_once_and_never_a_default_one() -> None:
    block = Gated("attribute")
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
def test_a_generator_reassigned_after_listing_is_the_one_stashed() -> None:
    """Attributes are looked up at every region, not remembered: a new generator object
    under the same name is the one replayed."""
    torch.manual_seed(0)
    block = Gated("attribute")
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(block):
        head(block(x)).sum().backward()
    block.generator = torch.Generator().manual_seed(7)
    block.noisy = True
    for _ in range(3):
        with scopedckpt.checkpointing(block):
            head(block(x)).sum().backward()
    # the generator advanced once per step, as in plain training from the same state
    reference = torch.Generator().manual_seed(7)
    for _ in range(3):
        torch.randn((3, 4), generator=reference)
    assert torch.equal(block.generator.get_state(), reference.get_state())


def test_a_generator_found_once_is_stashed_by_the_sites_later_calls() -> None:
    """One the region cannot reach without running (in a list) is found by the verified
    first call's watch and remembered for the site."""
    block = Gated("list")
    block.noisy = True
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(block):
        block(x).sum().backward()
    key = id(block)
    assert key in _generators._Sites.found
    (ref,) = _generators._Sites.found[key][1]
    assert ref() is block.generators[0]


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
    assert _generators._Sites.found == {}
