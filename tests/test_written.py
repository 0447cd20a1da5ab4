"""Parameters and buffers a region's forward writes outside its modules' own calls:
buffers replayed exactly from the buffer guard's copies of the region's subtree (NOTE [
buffer guard ]), parameters from copies where they were seen to change, and refused
before any backward where not (NOTE [ written parameters ] in ``_written.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import scopedckpt
from scopedckpt import testing


class Bank(nn.Module):
    """A memory bank updated through a method, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("queue", torch.zeros(12, 4))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    def push(self, keys: torch.Tensor) -> None:
        with torch.no_grad():
            i = int(self.pointer)
            self.queue[i : i + keys.shape[0]] = keys.detach()
            self.pointer.fill_((i + keys.shape[0]) % 12)


class CalledBank(Bank):
    """A bank that is called as a module as well as pushed through a method."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        queue = self.queue.clone()  # as it is now: pushed into later
        return (y @ queue.T) @ queue


class WithBank(nn.Module):
    """Pushes into its bank through a method and never calls it; subclasses that call it
    run the same set-up."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bank = CalledBank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        bank = self.bank.queue.clone()  # as it is before this step's keys
        out = y + (y @ bank.T) @ bank
        self.bank.push(y)
        return out


class ParentWritesChild(nn.Module):
    """The parent's forward updates a child's buffer; the child is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.stats = nn.Module()
        self.stats.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        with torch.no_grad():
            self.stats.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y - self.stats.mean


class PushAroundTheCall(WithBank):
    """Pushes before and after calling the bank: writes outside the bank's own call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.bank.push(y[:1])
        out = y + self.bank(y)
        self.bank.push(y[1:2] * 2)
        return out * self.bank.pointer


class EndsInsideTheBank(WithBank):
    """Pushes, then calls the bank last: torch's early stop ends the recompute inside the
    bank's call, with its guarded call unfinished."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.bank.push(y[:1])
        return self.bank(y.tanh())


class CountsItself(WithBank):
    """The region's own module counts its calls in a buffer: its whole forward is one
    guarded call, which torch's early stop ends inside."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x) * self.calls


class ReassignsChild(nn.Module):
    """Replaces a child's buffer by assignment (a new tensor, no in-place write)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.stats = nn.Module()
        self.stats.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats.count = self.stats.count + 1
        return self.linear(x) * self.stats.count


class PushesAroundANestedRegion(nn.Module):
    """A region that pushes into a bank, nested in one that pushes into it again and then
    reads it: the outer recompute runs the inner region's forward again, on the outer's
    copy (found by the property test)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = WithBank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = scopedckpt.checkpoint(self.inner, x)
        self.inner.bank.push(y)
        return y * self.inner.bank.queue.sum().tanh()


WRITERS = [
    WithBank,
    ParentWritesChild,
    PushAroundTheCall,
    EndsInsideTheBank,
    CountsItself,
    ReassignsChild,
    PushesAroundANestedRegion,
]


def _model(block: Callable[[], nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), block(), nn.Linear(4, 1))


def _embedded(how: str | None = None) -> nn.Sequential:
    """An embedding with max_norm (its weight renormalized in place at every call, hole 3)
    first in a block."""
    block = nn.Sequential(nn.Embedding(100, 16, max_norm=1.0), nn.Linear(16, 16))
    return nn.Sequential(block if how is None else Wrapped(block, how), nn.Linear(16, 1))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (6,))


@pytest.mark.parametrize("seed", range(10))
def test_a_parameter_changed_in_place_in_forward_trains_bit_identically(seed: int) -> None:
    """nn.Embedding(max_norm=...) renormalizes rows of its weight at every call; a second
    renormalization changed bits on some seeds (hole 3). The recompute now renormalizes a
    copy of the weight as it was before the region."""
    torch.manual_seed(seed)
    plain = _train(_embedded(), None, inputs=_tokens, seed=seed)
    torch.manual_seed(seed)
    checkpointed = _train(_embedded(), lambda m: (m[0],), inputs=_tokens, seed=seed)
    assert _equal(checkpointed, plain)


@pytest.mark.parametrize("how", ["module", "bound method"])
def test_parameters_changed_in_place_are_replayed_in_checkpoint_calls_too(how: str) -> None:
    torch.manual_seed(0)
    plain = _train(_embedded(how), None, inputs=_tokens)
    torch.manual_seed(0)
    checkpointed = _train(_embedded(how), lambda m: (), inputs=_tokens)
    assert _equal(checkpointed, plain)


def test_without_the_copies_a_renormalized_embedding_is_wrong() -> None:
    """Why the copies: the recompute renormalizes the renormalized rows again (which the
    light check, NOTE [ light check ], names where it reaches the region's tail)."""
    from scopedckpt.core import _mechanisms
    from scopedckpt.mechanisms import _written

    mechanisms = _mechanisms.MECHANISMS
    _mechanisms.MECHANISMS = tuple(m for m in mechanisms if m is not _written)
    previous = scopedckpt.set_verification_sampling(0)
    wrong = 0
    try:
        for seed in range(10):
            torch.manual_seed(seed)
            plain = _train(_embedded(), None, inputs=_tokens, seed=seed)
            torch.manual_seed(seed)
            try:
                checkpointed = _train(_embedded(), lambda m: (m[0],), inputs=_tokens, seed=seed)
            except scopedckpt.ScopedCkptError as error:
                assert "did not reproduce its first forward" in str(error)
                wrong += 1
            else:
                wrong += not _equal(checkpointed, plain)
    finally:
        _mechanisms.MECHANISMS = mechanisms
        scopedckpt.set_verification_sampling(previous)
    assert wrong > 0


class ClampsAChildsWeight(nn.Module):
    """The parent clamps a child nn.Linear's weight in place: torch's own layers are not
    copied (their forwards write no parameter), so the write is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.clamp_(-0.1, 0.1)
        return self.linear(x)


def test_a_parameter_written_without_a_copy_is_refused_naming_it() -> None:
    model = _model(ClampsAChildsWeight)
    with scopedckpt.checkpointing(model[1], root=model):
        with pytest.raises(scopedckpt.ScopedCkptError) as error:
            model(torch.randn(3, 4))
    message = str(error.value)
    assert "'1' (ClampsAChildsWeight)" in message  # the region
    assert "parameter 'linear.weight'" in message  # the parameter, by qualified name
    assert "outside the region" in message  # a fix


def _train(
    model: nn.Sequential,
    regions: Callable[[nn.Sequential], tuple[nn.Module, ...]] | None,
    steps: int = 3,
    inputs: Callable[[], torch.Tensor] = lambda: torch.randn(3, 4),
    seed: int = 1,
) -> list[torch.Tensor]:
    """Train ``steps`` SGD steps on fixed data; the gradients and state after each step."""
    torch.manual_seed(seed)
    data = [inputs() for _ in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    for x in data:
        optimizer.zero_grad()
        if regions is None:
            loss = model(x).sum()
        else:
            with scopedckpt.checkpointing(*regions(model), root=model):
                loss = model(x).sum()
        loss.backward(retain_graph=True)  # a second recompute, from the same copies
        loss.backward()
        optimizer.step()
        seen += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        seen += [b.clone() for b in model.buffers()]
    return seen


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("block", WRITERS, ids=lambda b: b.__name__)
def test_buffers_written_outside_their_modules_calls_train_bit_identically(
    block: type[nn.Module],
) -> None:
    """A bank pushed through a method, called or not; a child's statistics the parent
    updates; a child's buffer replaced by assignment (hole 4): exact, several steps, two
    recomputes per step, parameters and buffers bitwise."""
    plain = _train(_model(block), None)
    assert _equal(_train(_model(block), lambda m: (m[1],)), plain)


class Wrapped(nn.Module):
    """Regions made by the user's own checkpoint calls, over a module or a bound method."""

    def __init__(self, block: nn.Module, how: str) -> None:
        super().__init__()
        self.block = block
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "module":
            return scopedckpt.checkpoint(self.block, x)
        return scopedckpt.checkpoint(self.block.forward, x)


@pytest.mark.parametrize("how", ["module", "bound method"])
def test_writes_are_replayed_in_regions_of_checkpoint_calls_too(how: str) -> None:
    """The module a region runs is its owner, the module called, or a method's module."""
    plain = _train(_model(lambda: Wrapped(PushAroundTheCall(), how)), None)
    checkpointed = _train(_model(lambda: Wrapped(PushAroundTheCall(), how)), lambda m: ())
    assert _equal(checkpointed, plain)


@pytest.mark.parametrize("block", [WithBank, CountsItself], ids=lambda b: b.__name__)
def test_the_recompute_swaps_copies_in_and_puts_the_real_buffers_back(
    block: type[nn.Module],
) -> None:
    """Backward leaves the very tensors the first forward left, untouched, also where the
    recompute stops inside the owner's guarded call (the guard puts back the copy it found
    there, then the real one goes back)."""
    model = _model(block)
    x = torch.randn(3, 4)
    with scopedckpt.checkpointing(model[1], root=model):
        loss = model(x).sum()
    reals = [(b, b.clone(), b._version) for b in model[1].buffers()]
    loss.backward()
    assert all(a is b for (a, *_), b in zip(reals, model[1].buffers(), strict=True))
    for b, values, version in reals:
        assert torch.equal(b, values) and b._version == version


def test_the_same_models_without_the_subtree_s_copies_are_silently_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why the guard copies the whole subtree when a region starts: without it the
    recompute reads the pushed bank."""
    from scopedckpt.mechanisms import _guard

    plain = _train(_model(WithBank), None, steps=1)
    monkeypatch.setattr(_guard, "record_subtree", lambda *_: None)
    previous = scopedckpt.set_verification_sampling(0)
    try:
        checkpointed = _train(_model(WithBank), lambda m: (m[1],), steps=1)
    finally:
        scopedckpt.set_verification_sampling(previous)
    assert not _equal(checkpointed, plain)


class Stages(nn.Module):
    """Regions of one bound method running different stages: only the second pushes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = WithBank()

    def run(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) if stage == 0 else self.second(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in range(2):
            x = scopedckpt.checkpoint(self.run, stage, x)
        return x


def test_regions_over_one_module_running_different_code_copy_all_in_the_first_step() -> None:
    """The first region over ``Stages`` writes nothing; the second, in the same step,
    pushes: it still copied the bank, since no region over the module was recomputed."""
    plain = _train(_model(Stages), None)
    assert _equal(_train(_model(Stages), lambda m: ()), plain)


class SometimesPushes(WithBank):
    """Pushes into its bank only when told to: a write the first regions did not make."""

    push_now = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        queue = self.bank.queue.clone()
        out = y + (y @ queue.T) @ queue
        if self.push_now:
            self.bank.push(y)
        return out


def test_a_write_the_first_steps_did_not_make_is_replayed_exactly() -> None:
    """A bank pushed through a method from step 3 on (a warm-up switch): exact on every
    step, nothing to learn first."""

    def train(regions: Callable[[nn.Sequential], tuple[nn.Module, ...]] | None) -> list:
        model = _model(SometimesPushes)
        seen = _train(model, regions, steps=2)
        model[1].push_now = True
        return seen + _train(model, regions, steps=4)

    assert _equal(train(lambda m: (m[1],)), train(None))


def test_every_buffer_of_the_subtree_is_copied_once_per_region() -> None:
    """Every region over a module copies each guarded buffer of its subtree once, called
    or not: the memory report counts what stays on the tape."""
    model = _model(Holder)
    x = torch.randn(3, 4)
    rows = []
    for _ in range(2):
        with scopedckpt.memory_report(root=model) as report:
            with scopedckpt.checkpointing(model[1], root=model):
                loss = model(x).sum()
            loss.backward()
        rows.append(report.rows[0]["kept_bytes"])
    copies = sum(b.nbytes for b in model[1].buffers())  # the norm's and extra's
    stash = torch.get_rng_state().nbytes
    assert rows[0] == rows[1] == 3 * 4 * 4 + stash + copies  # the input, RNG stash, copies


class Holder(nn.Module):
    """Calls its first two children; ``extra`` (buffers, never called) is only held."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.extra = nn.Embedding(3, 4)
        self.extra.register_buffer("constant", torch.ones(4))
        self.count_in_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count_in_forward:
            self.late.count.add_(1)  # type: ignore[operator]
        return self.norm(self.linear(x))


def test_buffers_of_called_modules_and_untouched_ones_pass() -> None:
    """The guard's own case (a BatchNorm called in the region) and constant buffers."""
    model = _model(Holder)
    with scopedckpt.checkpointing(model[1], root=model):
        loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    assert int(model[1].norm.num_batches_tracked) == 1


def test_listings_follow_modules_registered_later() -> None:
    """A buffer registered after a module's first region is copied in the next one: the
    listing, and what regions over the module were seen to write, are made again."""

    def grow(model: nn.Sequential) -> None:
        model[1].late = nn.Module()
        model[1].late.register_buffer("count", torch.zeros(()))
        model[1].count_in_forward = True

    def train(region: bool) -> list[torch.Tensor]:
        model = _model(Holder)
        first = _train(model, (lambda m: (m[1],)) if region else None, steps=1)
        grow(model)
        return first + _train(model, (lambda m: (m[1],)) if region else None, steps=2)

    assert _equal(train(True), train(False))


@pytest.mark.parametrize("owner", ["block", "embedding"])
def test_a_listing_keeps_no_model_alive(owner: str) -> None:
    """The subtree listings are a cache by module: a model that goes takes its listing with
    it, and no parameter of it stays alive (a region over a container, and over a layer
    whose own parameters the listing names)."""
    import gc
    import weakref

    from scopedckpt.core import _subtree

    model = _embedded()
    region = model[0] if owner == "block" else model[0][0]
    with scopedckpt.checkpointing(region, root=model):
        model(_tokens()).sum().backward()
    key = id(region)
    assert key in _subtree._Listing.by_owner
    gone = [weakref.ref(model), weakref.ref(model[0][0].weight)]
    del model, region
    gc.collect()
    assert all(ref() is None for ref in gone)
    assert key not in _subtree._Listing.by_owner


def test_a_listing_made_during_a_recompute_names_no_swapped_copy() -> None:
    """Found by the property test: a counter assigning its buffer (``self.steps += 1``) made
    torch's registration hook fire, so a nested region listed the subtree again during its
    outer region's recompute, while copies were swapped in, and the next step's regions
    checked the versions of those copies instead of the real weight."""
    from .strategies import HookedCounter, InPlaceWeight, ProgramModel, Region

    program = (Region((1, Region((2, Region((0,), True)), False), 2), False),)
    torch.manual_seed(0)
    model = ProgramModel([nn.BatchNorm1d(1), HookedCounter(), InPlaceWeight(1)], program)
    testing.assert_checkpoint_equivalent(model, torch.randn(5, 1), targets=(), steps=3)


def test_a_buffer_assigned_under_its_own_name_keeps_the_listing() -> None:
    """``self.steps += 1`` registers the buffer again: no structural change, so the listing
    and what regions learned stay (they are rebuilt only when a name comes or goes)."""
    from scopedckpt.core import _subtree

    from .strategies import Counter

    model = _model(lambda: nn.Sequential(nn.Linear(4, 4), Counter()))
    x = torch.randn(3, 4)
    listings = []
    for _ in range(3):
        with scopedckpt.checkpointing(model[1], root=model):
            model(x).sum().backward()
        listings.append(_subtree.subtree(model[1]))
    assert listings[0] is listings[1] is listings[2]
    assert not listings[0].learning
