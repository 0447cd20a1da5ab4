"""Recomputes never change module state (NOTE [ buffer guard ])."""

from __future__ import annotations

import copy
import re
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scopedckpt
from scopedckpt.core import _subtree
from scopedckpt.core._light import RecomputeDivergenceError
from scopedckpt.mechanisms import _guard
from scopedckpt.testing import assert_checkpoint_equivalent


class FunctionalBatchNorm(nn.BatchNorm1d):
    """A subclass with its own forward, as timm's BatchNormAct2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,
            self.training, self.momentum or 0.1, self.eps,
        ).relu()  # fmt: skip


class Counter(nn.Module):
    """A step counter read after its update: the recompute must read the same number."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x * self.steps.clone()  # a copy: the next call's += must not hit a saved tensor


class Rebinding(nn.Module):
    """Updates its EMA buffer by assigning a new tensor rather than in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return x - self.ema


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), Counter()),
        nn.Sequential(nn.Linear(6, 6), FunctionalBatchNorm(6), Rebinding()),
        nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6)),  # power iteration buffers
    )


@pytest.mark.parametrize("backward", ["backward", "retain_graph", "grad_then_backward", "none"])
def test_unconverted_stateful_modules_are_updated_once(backward: str) -> None:
    model = _model()
    x = torch.randn(5, 6)
    assert_checkpoint_equivalent(model, x, steps=3, backward=backward)  # type: ignore[arg-type]
    # Nested regions, the same module inside several regions, the whole model.
    assert_checkpoint_equivalent(
        model,
        x,
        targets=[model, model[0], model[1][1], model[2]],
        steps=2,
        backward=backward,  # type: ignore[arg-type]
    )


def test_recompute_leaves_buffers_untouched() -> None:
    model = _model()
    x = torch.randn(5, 6, requires_grad=True)
    with scopedckpt.checkpointing(*model):
        loss = model(x).square().sum()
    after_forward = {n: b.clone() for n, b in model.named_buffers()}
    loss.backward()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, after_forward[name]), name
    assert int(model[0][2].steps) == 1 and int(model[0][1].num_batches_tracked) == 1


def test_a_module_called_twice_in_a_region_replays_each_call() -> None:
    torch.manual_seed(0)
    counter, bn = Counter(), nn.BatchNorm1d(6)
    model = nn.Sequential(bn, counter, bn, counter)
    assert_checkpoint_equivalent(model, torch.randn(4, 6), targets=[model], steps=2)


def test_region_owner_buffers_are_guarded() -> None:
    """A module target's own forward runs inside the region without __call__."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(6)
    assert_checkpoint_equivalent(bn, torch.randn(4, 6), targets=[bn], steps=2)
    assert_checkpoint_equivalent(bn, torch.randn(4, 6), targets=[nn.BatchNorm1d], steps=2)


def test_early_stop_and_errors_put_the_real_buffers_back() -> None:
    model = _model()
    x = torch.randn(5, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(model, x, early_stop=True)
    real = {n: b for n, b in model.named_buffers()}  # after the forward (Rebinding rebinds)
    # Only the first Linear's input grad is needed: the recompute stops early.
    torch.autograd.grad(out.sum(), x)
    for name, buffer in model.named_buffers():
        assert buffer is real[name], name
    assert not _guard.installed()  # the global hooks are gone with the last frame


# The first forward hooks every module call, strict mode and selective saving after it
# too (two global hooks); a recompute hooks nothing (its calls run on the copies put in
# when it starts) but for selective saving, which numbers its module calls.
@pytest.mark.parametrize(
    ("options", "expected"),
    [({}, [1, 0]), ({"strict": True}, [2, 0]), ({"save": [torch.ops.aten.sin]}, [2, 2])],
    ids=["plain", "strict", "selective"],
)
def test_hooks_are_installed_only_while_a_region_runs(
    options: dict[str, object], expected: list[int]
) -> None:
    seen: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(len(_guard.installed()))
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    assert not _guard.installed()
    with scopedckpt.checkpointing(**options):  # type: ignore[arg-type]
        out = scopedckpt.checkpoint(body, x)
    assert not _guard.installed()
    out.sum().backward()
    assert seen == expected and not _guard.installed()


class LateCounter(nn.Module):
    """A step counter registered after construction (``count()``), not in ``__init__``."""

    def count(self) -> LateCounter:
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "steps" not in self._buffers:
            return x
        self.steps += 1
        return x * self.steps.clone()


def test_the_guard_asks_each_instance_for_its_buffers() -> None:
    """The guard caches what a class says (self-guarded, Stateful), never whether an
    instance has buffers."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    plain = nn.Sequential(nn.Linear(6, 6), LateCounter())
    with scopedckpt.checkpointing():  # the class is seen in a region, with no buffers
        scopedckpt.checkpoint(plain, x.requires_grad_())
    assert not _subtree.guarded(plain[1])
    counting = nn.Sequential(nn.Linear(6, 6), LateCounter().count(), LateCounter())
    assert _subtree.guarded(counting[1]) and not _subtree.guarded(counting[2])
    assert_checkpoint_equivalent(counting, x, targets=[counting], steps=3)
    counting[2].count()  # between steps
    assert_checkpoint_equivalent(counting, x, targets=[counting], steps=3)


def test_scoped_batch_norm_skips_the_guard() -> None:
    bn = scopedckpt.BatchNorm1d(6)
    assert not _subtree.guarded(bn)
    assert _subtree.guarded(nn.BatchNorm1d(6))

    class Sub(scopedckpt.BatchNorm1d):  # its own forward: the guard takes it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    assert _subtree.guarded(Sub(6))
    assert_checkpoint_equivalent(Sub(6), torch.randn(4, 6), targets=[], steps=2,
                                 require_regions=False)  # fmt: skip


def test_strict_mode_names_the_module_changing_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4)))
    with (
        pytest.raises(
            scopedckpt.ScopedCkptError,
            match=re.escape(
                "scopedckpt: strict mode found '1.0' (BatchNorm1d) changing buffers in a region: "
                "use a scoped layer or turn strict off.\nIt changed running_mean, running_var, "
                "num_batches_tracked in the region of the root model (Sequential)."
            ),
        ),
        scopedckpt.checkpointing(model, strict=True, root=model),
    ):
        model(torch.randn(3, 4, requires_grad=True))
    converted = scopedckpt.convert(copy.deepcopy(model))
    with scopedckpt.checkpointing(converted, strict=True):
        converted(torch.randn(3, 4, requires_grad=True)).sum().backward()


def test_strict_mode_names_paths_relative_to_the_model_given_without_root() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("found '1' (BatchNorm1d)")),
        scopedckpt.checkpointing(model, strict=True),
    ):
        model(torch.randn(3, 4, requires_grad=True))


def test_a_buffer_a_call_left_unchanged_is_restored_too() -> None:
    """Found by the property test: the second update of a cumulative running variance
    rounded back to its own value, so that call's copy was dropped; by backward a later
    call had moved the buffer on, and the recompute updated it for real."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(1, momentum=None, affine=False)
    no_stats = nn.BatchNorm1d(1, momentum=None, affine=False, track_running_stats=False)

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.no_stats = bn, no_stats

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def middle(t: torch.Tensor) -> torch.Tensor:
                return scopedckpt.checkpoint(self.bn, self.no_stats(t), early_stop=False)

            inner = scopedckpt.checkpoint(middle, self.no_stats(x), early_stop=False)
            return self.bn(inner)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nested, self.bn = Nested(), bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(scopedckpt.checkpoint(self.nested, x, early_stop=False))

    assert_checkpoint_equivalent(
        Model(), torch.tensor([[1.5410], [-0.2934]]), targets=(), steps=2, seed=0
    )


def test_a_module_with_buffers_called_more_often_in_the_recompute_raises() -> None:
    """The path check names the region; the extra call updated the recompute's copies,
    not the real buffers."""
    bn = nn.BatchNorm1d(4)
    calls: list[int] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        for _ in range(len(calls)):
            x = bn(x)
        return x

    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x, early_stop=False)
    with pytest.raises(RecomputeDivergenceError, match="took another path than its first forward"):
        out.sum().backward()
    assert int(bn.num_batches_tracked) == 1


def test_a_recompute_hooks_no_module() -> None:
    """No hooks in a recompute (a global one would send every module call down
    nn.Module's slow path): its calls run on the copies put in when it starts."""
    bn, lin = nn.BatchNorm1d(4), nn.Linear(4, 4)
    seen: list[tuple[int, int, int]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(
            (len(_guard.installed()), len(bn._forward_pre_hooks), len(lin._forward_pre_hooks))
        )
        return bn(lin(x))

    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(body, x)
    out.sum().backward()
    assert seen == [(1, 0, 0), (0, 0, 0)]
    assert not bn._forward_pre_hooks and not bn._forward_hooks
    assert int(bn.num_batches_tracked) == 1


def test_lazy_modules_first_called_inside_a_region_are_exact() -> None:
    """Their buffers are placeholders until their first call: the guard initializes
    them first, as their own hook would, then copies them."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.LazyBatchNorm1d(), nn.LazyLinear(3))

    plain, checkpointed = build(), build()
    for step in range(3):
        x = torch.randn(4, 6)
        torch.manual_seed(step)  # the lazy Linear draws its weights in the first step
        plain(x).square().sum().backward()
        torch.manual_seed(step)
        with scopedckpt.checkpointing(checkpointed):
            out = checkpointed(x)
        out.square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(a, b), name
    assert type(checkpointed[1]) is nn.BatchNorm1d
    assert int(checkpointed[1].num_batches_tracked) == 3


class Placeholder(nn.Module):
    """An UninitializedBuffer with no initialize_parameters to fill it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", nn.parameter.UninitializedBuffer())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin()


def test_a_lazy_buffer_the_guard_cannot_initialize_is_refused() -> None:
    model = nn.Sequential(nn.Linear(6, 6), Placeholder())
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=re.escape(
            "scopedckpt: a lazy Placeholder was first called in the region of the module given "
            "to checkpointing() (Sequential): call the model once outside checkpointing first."
            "\n'1' (Placeholder) has uninitialized (lazy) buffers at its first call"
        ),
    ):
        with scopedckpt.checkpointing(model):
            model(x)
    assert not _guard.installed()


def test_the_class_cache_forgets_classes_made_at_run_time() -> None:
    """The guard caches per class by id: a class that goes must take its entry with it
    (an id reused by a new class would otherwise inherit the old class's answer)."""
    import gc

    made = type("Made", (nn.Linear,), {})
    layer = made(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with scopedckpt.checkpointing():
        scopedckpt.checkpoint(layer, x).sum().backward()
    key = id(made)
    assert key in _subtree._CLASSES
    del made, layer
    gc.collect()
    assert key not in _subtree._CLASSES


class InALambda(nn.Module):
    """Runs ``inner`` as a region of a lambda: a region over no module, which only the
    buffer guard keeps at the calls (a region over a module copies its subtree at its start)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scopedckpt.checkpoint(lambda t: self.inner(t), x)


@pytest.mark.parametrize("region", ["module", "lambda"])
def test_a_modules_own_pre_hook_updating_buffers_is_guarded_in_recomputes(region: str) -> None:
    """Spectral norm updates its ``weight_u`` buffer in a forward pre-hook of its own: the
    recompute's guard must swap the buffers before that hook runs (issue 25, hole 2)."""
    torch.manual_seed(0)
    normed = nn.utils.spectral_norm(nn.Linear(8, 8))
    block = nn.Sequential(normed, nn.ReLU())
    if region == "module":
        model = nn.Sequential(block, nn.Linear(8, 2))
        assert_checkpoint_equivalent(model, torch.randn(4, 8), targets=[model[0]], steps=3)
    else:
        model = nn.Sequential(InALambda(block), nn.Linear(8, 2))
        assert_checkpoint_equivalent(model, torch.randn(4, 8), targets=(), steps=3)


class PostCounted(nn.Module):
    """A buffer updated by the module's own forward (post) hook, read by its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.register_forward_hook(_count_call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1 + self.calls)


def _count_call(module: nn.Module, args: object, output: object) -> None:
    module.calls.add_(1)  # type: ignore[operator]


@pytest.mark.parametrize("region", ["module", "lambda"])
@pytest.mark.parametrize(
    "scope", [{}, {"strict": True}, {"save": [torch.ops.aten.mm]}, {"save": [nn.Linear]}]
)
def test_a_modules_own_post_hook_updating_buffers_is_guarded_in_recomputes(
    scope: dict[str, object], region: str
) -> None:
    """Per-module recompute hooks (plain) and the global ones (strict mode, selective
    saving) alike: the module's own post hook updates copies in the recompute (issue 25,
    hole 2, post hooks). A region over a lambda is kept by the guard alone."""
    torch.manual_seed(0)
    # A layer after it saves a tensor, so the recompute (early stop) runs its hooks too.
    block = nn.Sequential(nn.Linear(8, 8), PostCounted(), nn.Linear(8, 8))
    model = nn.Sequential(block if region == "module" else InALambda(block), nn.Linear(8, 2))
    targets = [model[0]] if region == "module" else []
    x = torch.randn(4, 8)
    for step in range(2):
        with scopedckpt.checkpointing(*targets, root=model, **scope):  # type: ignore[arg-type]
            loss = model(x).sum()
        loss.backward()
        assert float(block[1].calls) == step + 1
    assert_checkpoint_equivalent(model, x, targets=targets, steps=2, determinism_check="bitwise")


def test_a_global_pre_hook_updating_buffers_is_guarded() -> None:
    """A user's global forward pre-hook, registered before any region, that updates a
    buffer: the guard's own global hook goes first, in forwards and recomputes."""

    class Counted(nn.Linear):
        def __init__(self) -> None:
            super().__init__(6, 6)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * (1 + self.seen)

    def count(module: nn.Module, args: object) -> None:
        if isinstance(module, Counted):
            module.seen.add_(1)

    handle = nn.modules.module.register_module_forward_pre_hook(count)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(Counted(), nn.ReLU()), nn.Linear(6, 2))
        assert_checkpoint_equivalent(model, torch.randn(4, 6), targets=[model[0]], steps=3)
        torch.manual_seed(0)
        model = nn.Sequential(InALambda(nn.Sequential(Counted(), nn.ReLU())), nn.Linear(6, 2))
        assert_checkpoint_equivalent(model, torch.randn(4, 6), targets=(), steps=3)
    finally:
        handle.remove()


@pytest.mark.parametrize("switch", ["eval", "train"])
def test_a_mode_switch_between_forward_and_backward_recomputes_in_the_first_modes(
    switch: str,
) -> None:
    """``model.eval()`` (or ``.train()``) after the forward: plain training is unaffected
    (the graph is built), so the recompute of an unconverted model runs in the modes of
    the first forward, and the modes set later are back afterwards (issue 25, hole 7)."""
    x = torch.randn(5, 6)

    def run(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.3))
        model = nn.Sequential(block, nn.Linear(6, 2))
        model.train(switch == "eval")
        torch.manual_seed(1)
        with scopedckpt.checkpointing(block, enabled=checkpointed):
            loss = model(x).square().sum()
        getattr(model, switch)()
        loss.backward()
        assert all(m.training is (switch == "train") for m in model.modules())
        return [p.grad for p in model.parameters() if p.grad is not None] + list(model.buffers())

    plain, checkpointed = run(False), run(True)
    assert len(plain) == len(checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_every_recompute_starts_from_the_recorded_state() -> None:
    """A second recompute (``autograd.grad`` then ``backward``) swaps in a fresh copy of
    the recorded buffers: the first one's updates landed on its own copy. (A function
    region: no subtree, so only the guard keeps the counter's state.)"""
    from .strategies import Counter

    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), Counter(), nn.Linear(4, 4))
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        seen = []
        for _ in range(3):
            x = torch.randn(3, 4, requires_grad=True)
            with scopedckpt.checkpointing():
                out = scopedckpt.checkpoint(lambda x: block(x), x) if checkpointed else block(x)
            seen += torch.autograd.grad(out.square().sum(), x, retain_graph=True)
            optimizer.zero_grad()
            out.square().sum().backward()
            optimizer.step()
        return [*seen, *block.parameters(), *block.buffers()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


def test_early_stop_leaves_nested_targets_patched_for_the_next_recompute() -> None:
    """torch's early stop ends a recompute with an exception that is no failure: the
    nested target (a batch norm and a scoped dropout, whose mask is on its own tape) stays
    a region for the second recompute (``retain_graph``). Under a device context (a torch
    function mode), regions take torch's checkpoint, whose early stop raises."""

    def train(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.BatchNorm1d(4), scopedckpt.Dropout(0.5))
        block = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4))
        model = nn.Sequential(block, nn.Linear(4, 1))
        x = torch.randn(6, 4)
        scope = scopedckpt.checkpointing(block, block[1]) if checkpointed else nullcontext()
        with scope, torch.device("cpu"):
            loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [*model.buffers(), *(p.grad for p in model.parameters())]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)
