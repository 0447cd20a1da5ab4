"""Hypothesis strategies shared by the test suite: random models and regions.

A random model is a pool of shape-preserving layers (width ``c`` channels:
scoped layers, and unscoped random or stateful ones that the RNG replay and
the buffer guard must keep exact)
plus a *program*: a tree whose leaves are layer indices (a layer may appear
several times, in one region or in several) and whose inner nodes are
regions, possibly nested. :class:`ProgramModel` runs the program, calling
``scopedckpt.checkpoint`` for each region node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn

import scopedckpt
from scopedckpt.policies import keepable

RANKS = (2, 3, 4, 5)  # input (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W)

probabilities = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0, allow_nan=False, exclude_max=False)
)
momenta = st.one_of(st.none(), st.just(0.1), st.floats(0.01, 1.0))


@dataclass(frozen=True)
class Region:
    """A region node of a program; ``early_stop`` is passed to ``checkpoint``."""

    body: tuple[Program, ...]
    early_stop: bool


Program = int | Region


class FunctionalDropout(nn.Module):
    """Dropout through ``F.dropout``, as attention code calls it."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class DropPath(nn.Module):
    """Per-sample drop path with ``bernoulli_``, as timm's DropPath."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask.div_(keep) if keep > 0 else x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class OwnForwardBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A batch-norm subclass calling ``F.batch_norm`` itself, as timm's BatchNormAct2d."""

    def _check_input_dim(self, input: Tensor) -> None:
        pass

    def forward(self, x: Tensor) -> Tensor:
        average = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                average = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or self.running_mean is None
        return F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            use_batch,
            average,
            self.eps,
        )


class Noise(nn.Module):
    """Multiplicative noise from an out-of-place random op with a tensor argument
    (``torch.bernoulli(p)``), which selective saving may keep."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        return x * torch.bernoulli(torch.sigmoid(x))


class Counter(nn.Module):
    """A step-counter buffer updated in forward and read after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.steps += 1
        # At most 1: a growing factor compounds over many calls and steps until both
        # runs hold NaN, and NaN != NaN. A recompute counting twice reads another factor.
        return x * (1.0 - (self.steps % 4).to(x.dtype) * 0.125)


class HookedCounter(Counter):
    """A step counter updated by the module's own forward pre-hook (as the legacy
    ``spectral_norm`` updates its vectors), read by its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_pre_hook(_tick)

    def forward(self, x: Tensor) -> Tensor:
        return x * (1.0 - (self.steps % 4).to(x.dtype) * 0.125)


def _tick(module: nn.Module, args: Any) -> None:
    if module.training:
        module.steps += 1  # type: ignore[operator]


def _channels(x: Tensor) -> tuple[int, ...]:
    """The view that broadcasts a per-channel vector over ``x`` (channels at dim 1)."""
    return (1, -1) + (1,) * (x.dim() - 2)


class Statistics(nn.Module):
    """A running mean kept in a buffer, updated through a method, never called."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(c))

    def push(self, x: Tensor) -> None:
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            self.mean.mul_(0.5).add_(x.mean(dims), alpha=0.5)


class Banked(nn.Module):
    """Pushes its input's channel means into a child's buffer through a method (a memory
    bank's ``push``), then reads the buffer (NOTE [ buffer guard ]: exact)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bank = Statistics(c)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.bank.push(x)
        # At most a factor of 1.125 either way: bounded over many calls and steps.
        return x * (1.0 + 0.125 * torch.tanh(self.bank.mean)).view(_channels(x))


class InPlaceWeight(nn.Module):
    """A weight clamped in place in forward, as ``nn.Embedding(max_norm=...)``
    renormalizes rows (NOTE [ written parameters ]: the recompute clamps a copy)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c).uniform_(-2.0, 2.0))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.mul_(1.5).clamp_(-1.0, 1.0)
        # An add saves no operand: a second call's clamp leaves plain backward valid.
        return x + 0.125 * self.weight.view(_channels(x))


class PythonCoin(nn.Module):
    """Scales by a coin flipped with Python's ``random`` (LayerDrop's control flow; NOTE
    [ forward's world ]: the recompute draws the same)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 0.75 if random.random() < 0.5 else x.tanh()


class Tally(nn.Module):
    """Counts its calls in a plain attribute and scales by the count (NOTE [ forward's
    world ]: the recompute reads the count its first forward read)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x * (1.0 - (self.calls % 4) * 0.125)


class SizedAtFirstCall(nn.Module):
    """Sizes a per-channel buffer at its first call and assigns a new one at every call
    (an observer's running maximum, as QAT's fake-quantize keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.empty(0))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            seen = x.detach().abs().amax(dim=[d for d in range(x.dim()) if d != 1]) + 1.0
            self.peak = seen if self.peak.numel() == 0 else torch.maximum(self.peak, seen)
        return x / self.peak.view(_channels(x))


class Scale(nn.Module):
    """Scales each channel by a weight of its own."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, c))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight.view(_channels(x))


class FastWeights(nn.Module):
    """Runs its inner layer through ``torch.func.functional_call`` with fast weights made
    from the inner layer's own (MAML's inner step; NOTE [ forward's world ]: the recompute
    runs with the fast weights, which functional_call has unbound by then)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.inner = Scale(c)

    def forward(self, x: Tensor) -> Tensor:
        # Bounded by 1, as Counter's factor: a layer applied many times over many steps
        # must not grow until both runs hold NaN (and NaN != NaN).
        fast = {"weight": self.inner.weight.tanh()}
        return torch.func.functional_call(self.inner, fast, (x,))


class WarmUp(nn.Module):
    """Takes another branch from its third call on (a warm-up switch in control flow),
    counted in a plain attribute; inside, a ``torch.func.vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls <= 2:
            return x * 0.875
        return torch.func.vmap(torch.tanh)(x) * 1.25


class Hooked(nn.Module):
    """Carries a capture hook (appends to a list) and an output-replacing hook (NOTE
    [ hooks in recomputes ]: the recompute runs the second, not the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Tensor] = []
        self.register_forward_hook(_capture)
        self.register_forward_hook(_damp)

    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


def _capture(module: Hooked, args: object, output: Tensor) -> None:
    module.seen = [*module.seen[-3:], output.detach()]


def _damp(module: nn.Module, args: object, output: Tensor) -> Tensor:
    return output * 0.75


class OwnGenerator(nn.Module):
    """Adds noise drawn from a generator of its own, held as ``held`` says: where NOTE
    [ explicit generators ] replays it with verification off, as the property tests run
    (one held elsewhere needs a verified call or checkpointing(generators=...))."""

    HELD = ("attribute", "list", "dict")

    def __init__(self, seed: int, held: str = "attribute") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.held = held
        if held == "attribute":
            self.generator = generator
        elif held == "list":
            self.generators = [generator]
        else:
            self.by_name = {"noise": generator}

    def own(self) -> torch.Generator:
        """The generator, from where it is held."""
        if self.held == "attribute":
            return self.generator
        if self.held == "list":
            return self.generators[0]
        return self.by_name["noise"]

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.125 * torch.randn(x.shape, generator=self.own())


class SharedGenerator(nn.Module):
    """A scoped dropout and an unscoped op drawing from one generator of the module's (NOTE
    [ aligned draws ] in ``_dropout.py``: the replay rewinds it, the dropout redraws its
    seed)."""

    def __init__(self, seed: int, p: float) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.drop = scopedckpt.Dropout(p, generator=self.generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(x) + 0.125 * torch.rand(x.shape, generator=self.generator)


@st.composite
def layers(draw: st.DrawFn, rank: int, c: int, generators: bool = True) -> nn.Module:
    """One shape-preserving layer for input of ``rank`` with ``c`` channels; ``generators``:
    also layers drawing from generators of their own."""
    batch_norm = {
        2: scopedckpt.BatchNorm1d,
        3: scopedckpt.BatchNorm1d,
        4: scopedckpt.BatchNorm2d,
        5: scopedckpt.BatchNorm3d,
    }[rank]
    channel_dropout = {3: scopedckpt.Dropout1d, 4: scopedckpt.Dropout2d, 5: scopedckpt.Dropout3d}
    conv = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}
    torch_batch_norm = {
        2: nn.BatchNorm1d,
        3: nn.BatchNorm1d,
        4: nn.BatchNorm2d,
        5: nn.BatchNorm3d,
    }[rank]
    # Stateful layers are what can go wrong: draw them most often.
    kinds = ["batch_norm", "dropout", "batch_norm", "weights", "dropout", "activation"]
    kinds += ["alpha_dropout"] + (["channel_dropout", "feature_alpha_dropout"] if rank > 2 else [])
    # Unscoped ones: replayed by the RNG stash, guarded by the buffer guard.
    kinds += ["torch_dropout", "functional_dropout", "drop_path", "torch_batch_norm"]
    kinds += ["own_forward_batch_norm", "counter", "noise", "hooked_counter", "rrelu"]
    kinds += ["banked", "in_place_weight"]
    # The forward's world: Python's random, a plain attribute, a buffer assigned anew, user
    # hooks, functional_call's fast weights, a warm-up switch (with a torch.func transform).
    kinds += ["python_coin", "tally", "sized_at_first_call", "hooked", "fast_weights", "warm_up"]
    kinds += ["own_generator", "shared_generator"] if generators else []
    kind = draw(st.sampled_from(kinds))
    if kind == "own_generator":
        return OwnGenerator(draw(st.integers(0, 2**16)), draw(st.sampled_from(OwnGenerator.HELD)))
    if kind == "shared_generator":
        return SharedGenerator(draw(st.integers(0, 2**16)), draw(probabilities))
    if kind == "python_coin":
        return PythonCoin()
    if kind == "tally":
        return Tally()
    if kind == "fast_weights":
        return FastWeights(c)
    if kind == "warm_up":
        return WarmUp()
    if kind == "hooked":
        return Hooked()
    if kind == "sized_at_first_call":
        return SizedAtFirstCall()
    if kind == "banked":
        return Banked(c)
    if kind == "in_place_weight":
        return InPlaceWeight(c)
    if kind == "torch_dropout":
        return nn.Dropout(draw(probabilities))
    if kind == "functional_dropout":
        return FunctionalDropout(draw(probabilities))
    if kind == "drop_path":
        return DropPath(draw(probabilities))
    if kind == "counter":
        return Counter()
    if kind == "hooked_counter":
        return HookedCounter()
    if kind == "rrelu":  # saves its noise before writing it (NOTE [ late writes ])
        return nn.RReLU()
    if kind == "noise":
        return Noise()
    if kind in ("torch_batch_norm", "own_forward_batch_norm"):
        cls = torch_batch_norm if kind == "torch_batch_norm" else OwnForwardBatchNorm
        return cls(
            c,
            momentum=draw(momenta),
            affine=draw(st.booleans()),
            track_running_stats=draw(st.booleans()),
        )
    if kind == "weights":
        return nn.Linear(c, c) if rank == 2 else conv[rank](c, c, 3, padding=1)
    if kind == "activation":
        return draw(st.sampled_from([nn.ReLU, nn.Tanh, nn.SELU, nn.GELU]))()
    if kind == "dropout":
        return scopedckpt.Dropout(draw(probabilities), save_mask=draw(st.booleans()))
    if kind == "alpha_dropout":
        return scopedckpt.AlphaDropout(draw(probabilities))
    if kind == "channel_dropout":
        return channel_dropout[rank](draw(probabilities))
    if kind == "feature_alpha_dropout":
        return scopedckpt.FeatureAlphaDropout(draw(probabilities))
    return batch_norm(
        c,
        momentum=draw(momenta),
        affine=draw(st.booleans()),
        track_running_stats=draw(st.booleans()),
    )


@st.composite
def programs(draw: st.DrawFn, n_layers: int, depth: int = 0) -> tuple[Program, ...]:
    """A sequence of layer calls and (nested) regions over ``n_layers`` layers."""
    size = draw(st.integers(1, 4 if depth else 6))
    items: list[Program] = []
    for _ in range(size):
        if depth < 3 and draw(st.integers(0, 2)) == 0:
            body = draw(programs(n_layers, depth + 1))
            items.append(Region(body, draw(st.booleans())))
        else:
            items.append(draw(st.integers(0, n_layers - 1)))
    return tuple(items)


class ProgramModel(nn.Module):
    """Runs ``program`` over ``pool``, making each Region a checkpoint region."""

    def __init__(self, pool: list[nn.Module], program: tuple[Program, ...]) -> None:
        super().__init__()
        self.pool = nn.ModuleList(pool)
        self.program = program

    def _run(self, items: tuple[Program, ...], x: Tensor) -> Tensor:
        for item in items:
            if isinstance(item, Region):
                x = scopedckpt.checkpoint(self._run, item.body, x, early_stop=item.early_stop)
            else:
                x = self.pool[item](x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self._run(self.program, x)


@dataclass
class Case:
    """A random model, its input and how to train it."""

    model: ProgramModel
    x: Tensor
    seed: int
    steps: int

    def __repr__(self) -> str:  # Hypothesis prints this when an example fails
        return (
            f"Case(program={self.model.program}, x.shape={tuple(self.x.shape)}, "
            f"seed={self.seed}, steps={self.steps}, training={self.model.training},\n"
            f"pool={self.model.pool})"
        )


@st.composite
def cases(draw: st.DrawFn, max_steps: int = 3, generators: bool = True) -> Case:
    """A random model with random regions, input, seed and training mode; ``generators``:
    see :func:`layers`."""
    rank = draw(st.sampled_from(RANKS))
    c = draw(st.integers(1, 4))
    pool = draw(st.lists(layers(rank, c, generators), min_size=2, max_size=6))
    program = draw(programs(len(pool)))
    if not any(isinstance(item, Region) for item in program):
        program = (Region(program, draw(st.booleans())),)
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = ProgramModel(pool, program)
    model.train(draw(st.booleans()) or draw(st.booleans()))  # 3/4 training
    spatial = {2: (), 3: (3,), 4: (2, 3), 5: (2, 2, 2)}[rank]
    batch = draw(st.integers(2, 5))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn((batch, c, *spatial), generator=generator)
    seed = draw(st.integers(0, 2**32 - 1))
    return Case(model, x, seed, draw(st.integers(1, max_steps)))


_aten = torch.ops.aten

# Ops the random models call (out of place: selectable by an op item).
SAVABLE_OPS = (
    _aten.addmm,
    _aten.convolution,
    _aten.native_batch_norm,
    _aten.bernoulli,
    _aten.sigmoid,
    _aten.mul,
    _aten.add,
    _aten.gelu,
    _aten.relu,
    _aten.tanh,
    _aten.elu,
    _aten.lt,
    _aten.where,
    _aten.remainder,
)


def save_all_keepable(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    """A callable policy keeping every op it may keep: the most saving there is."""
    return keepable(op)


class EveryOther:
    """A stateful callable policy: every other out-of-place call. Decisions are made
    once, in the first forward, so even this replays exactly."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        self.calls += 1
        return self.calls % 2 == 0 and keepable(op)

    def __repr__(self) -> str:
        return "EveryOther()"


@st.composite
def save_policies(draw: st.DrawFn, model: nn.Module) -> list[Any]:
    """A random ``save=`` policy over ``model``: ops, module classes and instances,
    callables (no name patterns: ProgramModel's regions are functions)."""
    modules = [m for m in model.modules() if m is not model and not isinstance(m, nn.ModuleList)]
    items: list[Any] = []
    kinds = st.sampled_from(["op", "packet", "class", "instance", "callable"])
    for kind in draw(st.lists(kinds, min_size=1, max_size=4)):
        if kind == "op":
            packet = draw(st.sampled_from(SAVABLE_OPS))
            overloads = [
                getattr(packet, name)
                for name in packet.overloads()
                if keepable(getattr(packet, name))
            ]
            items.append(draw(st.sampled_from(overloads)))
        elif kind == "packet":
            items.append(draw(st.sampled_from(SAVABLE_OPS)))
        elif kind == "class" and modules:
            items.append(type(draw(st.sampled_from(modules))))
        elif kind == "instance" and modules:
            items.append(draw(st.sampled_from(modules)))
        elif kind == "callable":
            items.append(draw(st.sampled_from([save_all_keepable, EveryOther()])))
    return items


def count_scoped(model: nn.Module) -> dict[str, Any]:
    """How many scoped layers of each kind a model has (for test statistics)."""
    counts: dict[str, Any] = {}
    kinds = (
        nn.modules.dropout._DropoutNd,
        nn.modules.batchnorm._BatchNorm,
        FunctionalDropout,
        DropPath,
        Counter,
        Noise,
    )
    for m in model.modules():
        if isinstance(m, kinds):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


class BlockModel(nn.Module):
    """A stem, a ``ModuleList`` of blocks and a head: what ``scopedckpt.plan`` plans."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class BlockCase:
    """A random block model, its input, a seed, steps, and a budget as a fraction of the
    span from the smallest feasible budget (0) to the peak without checkpointing (1)."""

    model: BlockModel
    x: Tensor
    seed: int
    steps: int
    budget: float

    def __repr__(self) -> str:
        return (
            f"BlockCase(x.shape={tuple(self.x.shape)}, seed={self.seed}, steps={self.steps}, "
            f"budget={self.budget}, training={self.model.training},\nmodel={self.model})"
        )


@st.composite
def block_cases(draw: st.DrawFn, max_blocks: int = 6) -> BlockCase:
    """A random :class:`BlockModel` of random layers (as :func:`cases` draws them)."""
    rank = draw(st.sampled_from(RANKS))
    c = draw(st.integers(1, 4))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    blocks: list[nn.Module] = [
        nn.Sequential(*draw(st.lists(layers(rank, c), min_size=1, max_size=4)))
        for _ in range(draw(st.integers(2, max_blocks)))
    ]
    stem = nn.Linear(c, c) if rank == 2 else nn.Identity()
    model = BlockModel(stem, blocks, draw(layers(rank, c)))
    model.train(draw(st.booleans()) or draw(st.booleans()))
    spatial = {2: (), 3: (3,), 4: (2, 3), 5: (2, 2, 2)}[rank]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn((draw(st.integers(2, 5)), c, *spatial), generator=generator)
    budget = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0.0, 1.0))
    return BlockCase(model, x, draw(st.integers(0, 2**32 - 1)), draw(st.integers(1, 3)), budget)
