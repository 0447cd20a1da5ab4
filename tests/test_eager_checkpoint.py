"""The eager region's own checkpoint keeps torch's non-reentrant contract (NOTE [ eager
checkpoint ] in _eager_checkpoint.py): each test runs the same step through it, through
torch's checkpoint and plainly, and compares bit for bit, or compares the errors."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt
from scopedckpt.core import _eager_checkpoint, _engine

NULL = contextlib.nullcontext()


def ours(
    fn: Callable[..., Any], *args: Any, early_stop: bool = True, check: str = "default"
) -> Any:
    return _eager_checkpoint.run(fn, args, {}, NULL, NULL, check, early_stop)


def theirs(
    fn: Callable[..., Any], *args: Any, early_stop: bool = True, check: str = "default"
) -> Any:
    return tc.checkpoint(
        fn, *args, use_reentrant=False, early_stop=early_stop, determinism_check=check
    )


def plain(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
    return fn(*args)


WAYS = {"ours": ours, "torch": theirs, "plain": plain}


def _block(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Sigmoid())


def _grads(way: str, **options: Any) -> list[torch.Tensor]:
    block, head = _block(0), _block(1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    run = WAYS[way]
    y = run(block, x, **options)
    y = run(lambda t: head(t) * t, y, **options)  # regions in a row
    y.square().sum().backward()
    return [x.grad, *(p.grad for p in [*block.parameters(), *head.parameters()])]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("early_stop", [True, False])
def test_gradients_are_those_of_plain_training(early_stop: bool) -> None:
    expected = _grads("plain")
    assert _equal(_grads("ours", early_stop=early_stop), expected)
    assert _equal(_grads("torch", early_stop=early_stop), expected)


@pytest.mark.parametrize("inner", ["ours", "torch"])
@pytest.mark.parametrize("outer", ["ours", "torch"])
def test_nested_regions_mix_with_torchs_and_drop_the_inner_inputs(outer: str, inner: str) -> None:
    """A region inside another, either being torch's: exact, and the inner region's input
    (an activation of the outer one) is saved through the outer region's hooks."""
    block, head = _block(0), _block(1)
    x = torch.randn(4, 8, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        return WAYS[inner](head, torch.tanh(block(t)))

    WAYS[outer](body, x).sum().backward()
    got = [x.grad, *(p.grad for p in [*block.parameters(), *head.parameters()])]
    x.grad = None
    for p in [*block.parameters(), *head.parameters()]:
        p.grad = None
    body(x).sum().backward()
    assert _equal(got, [x.grad, *(p.grad for p in [*block.parameters(), *head.parameters()])])

    packed: list[torch.Tensor] = []

    def count(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        ours(torch.sin, x)
    assert len(packed) == 1 and packed[0] is x  # the region's input, saved as autograd saves


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_retained_graphs_recompute_for_each_backward(way: str) -> None:
    block = _block()
    x = torch.randn(4, 8, requires_grad=True)
    loss = WAYS[way](block, x).square().sum()
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    expected = torch.autograd.grad(block(x).square().sum(), x)[0]
    assert torch.equal(first, expected) and torch.equal(x.grad, expected)


class _TwiceSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors  # noqa: B018 - unpacked once here, and again below
        (x,) = ctx.saved_tensors
        return grad * 2 + 0 * x


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_unpacking_a_tensor_twice_is_torchs_error(way: str) -> None:
    x = torch.randn(3, requires_grad=True)
    y = WAYS[way](lambda t: _TwiceSaved.apply(t.sin()), x)
    with pytest.raises(tc.CheckpointError, match="already unpacked once"):
        y.sum().backward()


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_a_recompute_saving_less_or_other_shapes_is_torchs_error(way: str) -> None:
    """Both raise torch's CheckpointError; ours says which region took another path
    (NOTE [ light check ]) and is a ScopedCkptError too."""
    calls = []

    def fewer(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sin().sin() if len(calls) == 1 else t.sin() * 1.0

    x = torch.randn(3, requires_grad=True)
    message = {
        "torch": "A different number of tensors was saved",
        "ours": "took another path than its first forward; keep data-dependent branches out "
        "of the region.\nThe forward saved 2 tensors for backward, the recompute 1",
    }[way]
    with pytest.raises(tc.CheckpointError, match=message) as raised:
        WAYS[way](fewer, x, early_stop=False).sum().backward()
    assert isinstance(raised.value, scopedckpt.ScopedCkptError) == (way == "ours")

    def reshaped(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        u = t if len(calls) % 2 else t.reshape(3, 1)
        return u.sin().sum()

    calls.clear()
    with pytest.raises(tc.CheckpointError, match="different metadata") as raised:
        WAYS[way](reshaped, x).backward()
    assert "'shape': torch.Size([3])" in str(raised.value)
    calls.clear()
    WAYS[way](reshaped, x, check="none").backward()  # "none" compares nothing


@pytest.mark.parametrize("way", ["ours", "torch"])
@pytest.mark.parametrize("switch", [None, True, False])
def test_early_stop_follows_torchs_switch(way: str, switch: bool | None) -> None:
    """Early stop ends the recompute after the last saved tensor; torch's
    ``set_checkpoint_early_stop`` overrides the argument."""
    after: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.sin()
        after.append(1)  # after the last saved tensor
        return y + 1

    x = torch.randn(3, requires_grad=True)
    switched = contextlib.nullcontext() if switch is None else tc.set_checkpoint_early_stop(switch)
    with switched:
        y = WAYS[way](fn, x, early_stop=True)
    y.sum().backward()
    assert len(after) == (1 if switch in (None, True) else 2)


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_the_recompute_runs_in_the_first_forwards_autocast(way: str) -> None:
    block = _block()
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = WAYS[way](block, x)
    with torch.autocast("cpu", enabled=False):
        y.float().square().sum().backward()
    got = [x.grad, *(p.grad for p in block.parameters())]
    x.grad = None
    block.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    y.float().square().sum().backward()
    assert _equal(got, [x.grad, *(p.grad for p in block.parameters())])


@pytest.mark.parametrize("way", ["ours", "torch"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_backward_inside_the_forward(way: str, early_stop: bool) -> None:
    """A gradient taken inside the region (a gradient penalty) recomputes mid-forward."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.sin() * t
        (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
        return (g * t).cos()

    x = torch.randn(5, requires_grad=True)
    WAYS[way](fn, x, early_stop=early_stop).sum().backward()
    got = x.grad
    x.grad = None
    fn(x).sum().backward()
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_a_graph_the_recompute_built_keeps_nothing_of_the_region(way: str) -> None:
    """A tensor the forward stores on the side outlives the step with the graph the
    recompute built for it: that graph holds the region only weakly (its function,
    contexts and recomputed tensors go with the step)."""
    kept: dict[str, torch.Tensor] = {}

    class Stores(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            y = t.exp()
            kept["y"] = y
            return y.sin()

    module = Stores()
    alive = weakref.ref(module)
    x = torch.randn(64, requires_grad=True)
    out = WAYS[way](module, x)
    del module
    out.sum().backward()
    del out
    gc.collect()
    assert kept["y"].grad_fn is not None  # the recompute's graph is still there
    assert alive() is None


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_a_failed_forward_leaves_no_hooks_behind(way: str) -> None:
    def fails(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise ValueError("boom")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        WAYS[way](fails, x)
    y = x.sin()  # saved plainly again: no region hook is left in force
    assert y.grad_fn._saved_self is x  # type: ignore[union-attr]


def test_regions_take_it_unless_torchs_own_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain eager regions run the eager checkpoint; a caller's context_fn, debug mode or
    an active torch function mode (a device context) send the region through torch's."""
    calls: list[int] = []
    real = _eager_checkpoint.run

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_eager_checkpoint, "run", spy)
    model = nn.Sequential(_block(), nn.Linear(8, 1))
    x = torch.randn(4, 8)

    def step(**options: Any) -> int:
        calls.clear()
        with scopedckpt.checkpointing():
            y = scopedckpt.checkpoint(model[0], x, **options)
        model[1](y).sum().backward()
        return len(calls)

    assert step() == 1
    assert step(determinism_check="none") == 1
    assert step(context_fn=tc.noop_context_fn) == 1
    assert step(context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext())) == 0
    assert step(debug=True) == 0
    with torch.device("cpu"):
        assert step() == 0
    assert _engine.COUNTERS.recomputes > 0


@pytest.mark.parametrize("way", ["ours", "torch"])
def test_a_failed_recompute_runs_again_at_the_next_backward_of_its_group(way: str) -> None:
    calls: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("the first recompute fails")
        return t.sin().sin()

    x = torch.randn(3, requires_grad=True)
    y = WAYS[way](fn, x).sum()
    with tc.GraphExecGroup():
        with pytest.raises(ValueError, match="first recompute"):
            y.backward(retain_graph=True)
        y.backward()
    assert torch.equal(x.grad, torch.autograd.grad(x.sin().sin().sum(), x)[0])
