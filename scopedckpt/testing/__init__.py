"""Check your own model in CI: checkpointed training must equal plain training.

:func:`assert_checkpoint_equivalent` trains two identical copies of a model
from identical RNG states, one inside ``checkpointing(...)`` and one without,
and compares every output, gradient, buffer and the global RNG state bit for
bit. Hypothesis strategies to drive it live in
:mod:`scopedckpt.testing.strategies` (``pip install 'scopedckpt[testing]'``).
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from ..core._engine import COUNTERS
from ..core._sampling import suspended
from ..core._scope import Target, checkpointing
from ..planner._plan import Plan

__all__ = ["assert_checkpoint_equivalent", "default_loss"]

BackwardMode = Literal["backward", "retain_graph", "grad_then_backward", "none"]
_BACKWARD_MODES = get_args(BackwardMode)


def _tensors(value: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in a nested output, with a readable path."""
    if isinstance(value, Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{index}]")


def default_loss(output: Any) -> Tensor:
    """Sum of the mean squares of every floating tensor in ``output``.

    Example
    -------
    >>> import torch
    >>> from scopedckpt.testing import default_loss
    >>> float(default_loss((torch.ones(2), {"a": torch.full((3,), 2.0)})))
    5.0
    """
    terms = [t.float().square().mean() for _, t in _tensors(output, "") if t.is_floating_point()]
    if not terms:
        raise ValueError(
            "scopedckpt: default_loss found no floating-point tensor in the model output; "
            "pass loss_fn=... that turns the output into a scalar."
        )
    return torch.stack(terms).sum()


@dataclass
class _Snapshot:
    """Named tensors of one run, in the order they were taken."""

    tensors: list[tuple[str, Tensor]] = field(default_factory=list)

    def add(self, name: str, value: Tensor | None) -> None:
        if value is not None:
            self.tensors.append((name, value.detach().clone()))


def _describe_difference(a: Tensor, b: Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if not (a.is_floating_point() or a.is_complex()):
        a, b = a.double(), b.double()
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(a) != torch.isnan(b), torch.inf, diff.nan_to_num(0.0))
    # Only called for unequal tensors of one shape, so never for empty ones.
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), a.shape))
    count = int((a != b).sum())
    return (
        f"max abs diff {float(diff.max()):.3g} at index {index} (checkpointed "
        f"{a[index].item()!r} vs plain {b[index].item()!r}); {count} of {a.numel()} "
        "elements differ"
    )


def _compare(checkpointed: _Snapshot, plain: _Snapshot) -> None:
    names_a = [n for n, _ in checkpointed.tensors]
    names_b = [n for n, _ in plain.tensors]
    if names_a != names_b:
        missing = sorted(set(names_a) ^ set(names_b))
        raise AssertionError(
            f"scopedckpt: the checkpointed and plain runs produced different tensors: {missing}"
        )
    for (name, a), (_, b) in zip(checkpointed.tensors, plain.tensors):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            raise AssertionError(
                f"scopedckpt: {name} differs between the checkpointed and the plain run: "
                f"{_describe_difference(a, b)}."
            )


def _run(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], Tensor],
    scope: Callable[[nn.Module], checkpointing] | None,
    steps: int,
    seed: int,
    backward: BackwardMode,
    lr: float,
) -> _Snapshot:
    snap = _Snapshot()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    python = random.getstate()  # both runs start Python's random from the seed too
    random.seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            tag = f"step {step}:"
            leaves = tuple(
                x.detach().clone().requires_grad_(x.is_floating_point())
                if isinstance(x, Tensor)
                else x
                for x in inputs
            )
            for _, p in params:
                p.grad = None
            with contextlib.nullcontext() if scope is None else scope(model):
                output = model(*leaves)
            loss = loss_fn(output)
            for name, t in _tensors(output, "output"):
                snap.add(f"{tag} {name}", t)
            snap.add(f"{tag} loss", loss)
            if backward != "none":
                wrt = [p for _, p in params] + [
                    x for x in leaves if isinstance(x, Tensor) and x.requires_grad
                ]
                if backward in ("retain_graph", "grad_then_backward"):
                    grads = torch.autograd.grad(loss, wrt, retain_graph=True, allow_unused=True)
                    for index, g in enumerate(grads):
                        snap.add(f"{tag} autograd.grad #{index}", g)
                loss.backward(retain_graph=backward == "retain_graph")
                if backward == "retain_graph":
                    loss.backward()  # a second recompute of every region
                for name, p in params:
                    snap.add(f"{tag} gradient of parameter '{name}'", p.grad)
                for index, x in enumerate(leaves):
                    if isinstance(x, Tensor):
                        snap.add(f"{tag} gradient of input #{index}", x.grad)
            for name, b in model.named_buffers():
                snap.add(f"{tag} buffer '{name}'", b)
            snap.add(f"{tag} global RNG state", torch.get_rng_state())
            snap.add(f"{tag} Python random state", torch.tensor(random.getstate()[1]))
            if backward != "none":
                with torch.no_grad():
                    for _, p in params:
                        if p.grad is not None:
                            p.sub_(p.grad, alpha=lr)
            for name, p in params:
                snap.add(f"{tag} parameter '{name}' after the update", p)
    random.setstate(python)
    return snap


def assert_checkpoint_equivalent(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], Tensor] | None = None,
    targets: Sequence[Target] | None = None,
    steps: int = 1,
    seed: int = 0,
    backward: BackwardMode = "backward",
    lr: float = 0.01,
    require_regions: bool = True,
    save: Sequence[Any] | None = None,
    determinism_check: str | None = None,
) -> None:
    """Assert that training ``model`` with checkpointing is bit-for-bit training without.

    Two deep copies of ``model`` run ``steps`` training steps (forward, loss,
    backward, an SGD update) from the same seed: one inside
    ``checkpointing(*targets, save=save)``, one without. Outputs, loss, every parameter
    gradient, every input gradient, every buffer (``running_mean``,
    ``num_batches_tracked``...), the global RNG state and the updated
    parameters are compared with ``torch.equal`` after every step. The model
    itself is not changed and the caller's RNG state is restored.

    Parameters
    ----------
    model
        The model, in the mode (train/eval) to check.
    *example_inputs
        Its positional inputs; floating tensors get ``requires_grad``.
    loss_fn
        Output to scalar; :func:`default_loss` if omitted.
    targets
        What ``checkpointing`` selects; ``None`` selects each direct child of
        ``model`` (or ``model`` itself if it has none). ``()`` selects nothing,
        for models whose code calls :func:`scopedckpt.checkpoint` itself. A
        :class:`scopedckpt.Plan` of ``model`` is bound to the copy.
    steps
        Training steps to run and compare.
    seed
        The seed both runs start from.
    backward
        ``"backward"``; ``"retain_graph"`` (``autograd.grad`` and two
        ``backward`` calls: every region is recomputed three times);
        ``"grad_then_backward"``; or ``"none"`` (forward only).
    lr
        SGD learning rate of the update between steps.
    require_regions
        Fail if the checkpointed run made no checkpoint region, so a test
        cannot pass by checkpointing nothing.
    save
        A selective-saving policy for the checkpointed run (see
        :func:`scopedckpt.checkpointing`); module instances in it are mapped
        onto the copy like ``targets``.
    determinism_check
        The checkpointed run's ``checkpointing(determinism_check=...)``:
        ``"bitwise"`` also verifies each recompute from fingerprints, raising
        :class:`scopedckpt.ScopedCkptError` at the first saved tensor a
        recompute did not reproduce.

    Raises
    ------
    AssertionError
        Naming the first mismatching tensor (e.g. ``step 0: gradient of
        parameter '0.weight'``) and how far apart the two runs are.

    Example
    -------
    >>> import torch, scopedckpt
    >>> from scopedckpt.testing import assert_checkpoint_equivalent
    >>> model = scopedckpt.convert(torch.nn.Sequential(
    ...     torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.3),
    ...     torch.nn.Linear(6, 2)))
    >>> assert_checkpoint_equivalent(model, torch.randn(5, 6), steps=2)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"scopedckpt: assert_checkpoint_equivalent expected an nn.Module as model, got "
            f"{type(model).__name__}."
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"scopedckpt: steps must be a positive int, got {steps!r}.")
    if backward not in _BACKWARD_MODES:
        raise ValueError(
            f"scopedckpt: backward must be one of {_BACKWARD_MODES}, got {backward!r}."
        )
    loss = loss_fn if loss_fn is not None else default_loss
    plain_model = copy.deepcopy(model)
    checkpointed_model = copy.deepcopy(model)

    def scope(copy_of_model: nn.Module) -> checkpointing:
        policy = None if save is None else _retarget(save, model, copy_of_model)
        if targets is None:
            chosen: list[Any] = list(copy_of_model.children()) or [copy_of_model]
        else:
            chosen = _retarget(targets, model, copy_of_model)
        root = None if targets is None else copy_of_model
        return checkpointing(*chosen, root=root, save=policy, determinism_check=determinism_check)

    plain = _run(plain_model, example_inputs, loss, None, steps, seed, backward, lr)
    before = COUNTERS.regions
    # Without a check asked for, the runs are compared below, naming the values that
    # differ; sampled verification would raise first, naming only the op.
    with suspended() if determinism_check is None else contextlib.nullcontext():
        checkpointed = _run(
            checkpointed_model, example_inputs, loss, scope, steps, seed, backward, lr
        )
    if require_regions and COUNTERS.regions == before:
        raise AssertionError(
            "scopedckpt: the checkpointed run made no checkpoint region, so the comparison "
            "proves nothing. Pass targets=... selecting modules that run, or call "
            "scopedckpt.checkpoint in the model code (and make sure grad is enabled)."
        )
    _compare(checkpointed, plain)


def _retarget(targets: Sequence[Any], original: nn.Module, copied: nn.Module) -> list[Any]:
    """Map module targets (or save= items) of ``original`` onto the same submodules of
    ``copied``."""
    by_id = {id(m): name for name, m in original.named_modules()}
    copied_modules = dict(copied.named_modules())
    result: list[Any] = []
    for target in targets:
        if isinstance(target, Plan):
            result.append(target.bind(copied))
        elif isinstance(target, nn.Module):
            if id(target) not in by_id:
                raise ValueError(
                    f"scopedckpt: target {type(target).__name__} is not a submodule of the "
                    "model; pass modules of the model, module classes or predicates."
                )
            result.append(copied_modules[by_id[id(target)]])
        else:
            result.append(target)
    return result
