"""scopedckpt as a drop-in for torch.utils.checkpoint: every keyword, helper and switch.

Written from torch's documented behaviour. On models without stateful layers both must
agree bit for bit; on models with batch norm and unscoped dropout only scopedckpt equals
training without checkpointing.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils.checkpoint import CheckpointError, CheckpointPolicy
from torch.utils.checkpoint import checkpoint as bound_torch_checkpoint

import scopedckpt
from scopedckpt import Phase
from scopedckpt.core._engine import COUNTERS
from scopedckpt.integrations import patch_torch_checkpoint


def _stateless() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.GELU())


def _stateful() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.4), nn.Linear(6, 6))


Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _train(model: nn.Module, run: Run, seed: int = 1) -> list[torch.Tensor]:
    """One step from ``seed``: output, input and parameter grads, buffers, RNG state."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = run(model, x)
    out.square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    return [out.detach(), x.grad, *grads, *model.buffers(), torch.get_rng_state()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _ours(**options: Any) -> Run:
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scopedckpt.checkpointing():
            return scopedckpt.checkpoint(model, x, **options)

    return run


def _torchs(**options: Any) -> Run:
    return lambda model, x: tc.checkpoint(model, x, **options)


def _plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


FORMS = [
    {"use_reentrant": False},
    {"use_reentrant": False, "preserve_rng_state": False},
    {"use_reentrant": False, "determinism_check": "none"},
    {"use_reentrant": False, "early_stop": False},
    {"use_reentrant": False, "debug": True},
    {"use_reentrant": False, "context_fn": tc.noop_context_fn},
]


@pytest.mark.parametrize("options", FORMS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_keyword_form_agrees_with_torch_where_torch_is_exact(options: dict) -> None:
    model = _stateless()
    assert _equal(_train(model, _ours(**options)), _train(model, _torchs(**options)))
    assert _equal(_train(model, _ours(**options)), _train(model, _plain))


@pytest.mark.parametrize("options", FORMS[:1] + FORMS[2:], ids=str)
def test_every_keyword_form_is_exact_where_torch_is_not(options: dict) -> None:
    model = _stateful()
    assert _equal(_train(model, _ours(**options)), _train(model, _plain))
    assert not _equal(_train(model, _torchs(**options)), _train(model, _plain))  # BN twice


def test_use_reentrant_unset_is_non_reentrant_and_true_is_refused() -> None:
    model = _stateful()
    assert _equal(_train(model, _ours()), _train(model, _plain))
    with pytest.raises(
        scopedckpt.ScopedCkptError,
        match=r"^scopedckpt: checkpoint\(use_reentrant=True\) of .* cannot be exact: pass "
        r"use_reentrant=False",
    ):
        _train(model, _ours(use_reentrant=True))


def test_keywords_not_named_by_torch_go_to_fn() -> None:
    def fn(x: torch.Tensor, *, scale: float, shift: torch.Tensor) -> torch.Tensor:
        return x.sin() * scale + shift

    x = torch.ones(3, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(fn, x, use_reentrant=False, scale=2.0, shift=torch.ones(3))
    out.sum().backward()
    assert torch.equal(x.grad, 2.0 * torch.cos(torch.ones(3)))


class _PhaseSpy:
    """A user context: records the phase scopedckpt has set when it is entered."""

    def __init__(self, seen: list[Phase]) -> None:
        self.seen = seen

    def __enter__(self) -> None:
        self.seen.append(scopedckpt.phase())

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_users_context_fn_runs_inside_ours_in_forward_and_every_recompute() -> None:
    seen: list[Phase] = []
    spy = _PhaseSpy(seen)
    x = torch.randn(3, 6, requires_grad=True)
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(_stateless(), x, context_fn=lambda: (spy, spy))
    loss = out.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert seen == [Phase.FORWARD, Phase.RECOMPUTE, Phase.RECOMPUTE]


def _sac(policy_ops: tuple[object, ...]) -> Callable[[], tuple[Any, Any]]:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in policy_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: tc.create_selective_checkpoint_contexts(policy)


def test_torchs_selective_checkpoint_contexts_compose() -> None:
    model = _stateless()
    context_fn = _sac((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
    ours = _train(model, _ours(use_reentrant=False, context_fn=context_fn))
    assert _equal(ours, _train(model, _torchs(use_reentrant=False, context_fn=context_fn)))
    assert _equal(ours, _train(model, _plain))


def _mismatching(x: torch.Tensor, calls: list[int]) -> torch.Tensor:
    calls.append(1)
    n = 3 if len(calls) == 1 else 2  # the recompute saves a tensor of another shape
    return x[:n].sin().sum() * x


@pytest.mark.parametrize(
    "switch", [False, True], ids=["debug=True", "set_checkpoint_debug_enabled"]
)
@pytest.mark.usefixtures("no_sampling")  # torch's own check's message, not ours
def test_debug_mode_dumps_torchs_operator_logs_on_a_mismatch(switch: bool) -> None:
    calls: list[int] = []
    x = torch.randn(4, requires_grad=True)
    with scopedckpt.checkpointing(), tc.set_checkpoint_debug_enabled(True if switch else None):
        out = scopedckpt.checkpoint(_mismatching, x, calls, debug=not switch, early_stop=False)
    with pytest.raises(CheckpointError, match="because you passed `debug=True`"):
        out.sum().backward()
    with scopedckpt.checkpointing():
        out = scopedckpt.checkpoint(_mismatching, x, [], early_stop=False)
    with pytest.raises(CheckpointError) as plain_error:
        out.sum().backward()
    assert "debug=True" not in str(plain_error.value).split("\n")[0]


def test_set_checkpoint_early_stop_is_honoured() -> None:
    seen: list[Phase] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()  # the only tensor backward needs
        seen.append(scopedckpt.phase())  # runs in the recompute only without early stop
        return y * 2

    x = torch.randn(3, requires_grad=True)
    for early_stop, expected in (
        (True, [Phase.FORWARD]),
        (False, [Phase.FORWARD, Phase.RECOMPUTE]),
    ):
        seen.clear()
        with scopedckpt.checkpointing(), tc.set_checkpoint_early_stop(early_stop):
            out = scopedckpt.checkpoint(body, x)
        out.sum().backward()
        assert seen == expected


def test_checkpoint_sequential_matches_torch_and_is_exact() -> None:
    torch.manual_seed(0)
    stateless = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)])
    stateful = nn.Sequential(*_stateful(), nn.BatchNorm1d(6), nn.Dropout(0.3))

    def ours(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scopedckpt.checkpointing():
            return scopedckpt.checkpoint_sequential(model, 3, x, use_reentrant=False)

    def torchs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint_sequential(model, 3, x, use_reentrant=False)

    assert _equal(_train(stateless, ours), _train(stateless, torchs))
    assert _equal(_train(stateful, ours), _train(stateful, _plain))
    assert not _equal(_train(stateful, torchs), _train(stateful, _plain))
    before = COUNTERS.regions
    _train(stateful, ours)
    assert COUNTERS.regions - before == 2  # segments - 1 regions; the last chunk runs plainly


def test_checkpoint_sequential_rejects_what_torch_rejects() -> None:
    model = _stateless()
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match=re.escape("unexpected keyword arguments ['bogus']")):
        scopedckpt.checkpoint_sequential(model, 2, x, bogus=1)
    with pytest.raises(scopedckpt.ScopedCkptError, match="use_reentrant=True"):
        scopedckpt.checkpoint_sequential(model, 2, x, use_reentrant=True)


# ------------------------------------------------------------------- patch_torch_checkpoint


def _patched(call: Run) -> Run:
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with patch_torch_checkpoint():
            return call(model, x)

    return run


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: tc.checkpoint(m, x, use_reentrant=False),
        lambda m, x: tc.checkpoint(m, x),  # unset: non-reentrant inside the patch
        lambda m, x: bound_torch_checkpoint(m, x, use_reentrant=False),
        lambda m, x: tc.checkpoint_sequential(m, 2, x),
        lambda m, x: tc.checkpoint(m, x, use_reentrant=False, debug=True),
    ],
    ids=["attribute", "unset", "bound-name", "sequential", "debug"],
)
def test_patched_torch_calls_become_exact_regions(call: Run) -> None:
    model = _stateful()
    before = COUNTERS.regions
    assert _equal(_train(model, _patched(call)), _train(model, _plain))
    assert COUNTERS.regions > before


def test_a_partial_made_before_the_patch_is_patched_too() -> None:
    import functools

    stored = functools.partial(bound_torch_checkpoint, use_reentrant=False)  # as Hugging Face does
    model = _stateful()
    assert _equal(_train(model, _patched(lambda m, x: stored(m, x))), _train(model, _plain))


def test_reentrant_calls_are_refused_inside_the_patch_only() -> None:
    model = _stateful()
    with pytest.raises(scopedckpt.ScopedCkptError, match="cannot be exact"):
        _train(model, _patched(lambda m, x: tc.checkpoint(m, x, use_reentrant=True)))
    _train(model, lambda m, x: tc.checkpoint(m, x, use_reentrant=True))  # torch's own outside


def test_the_patch_is_removed_on_exit_and_on_exceptions() -> None:
    from scopedckpt.core._torch_private import PATH

    names = {PATH.front, PATH.generator, PATH.reentrant, "checkpoint", "checkpoint_sequential"}
    originals = {n: getattr(tc, n) for n in names if n is not None}
    with pytest.raises(KeyError), patch_torch_checkpoint(), patch_torch_checkpoint():
        assert getattr(tc, PATH.front) is not originals[PATH.front]
        assert getattr(tc, PATH.generator) is not originals[PATH.generator]
        raise KeyError("boom")
    assert {n: getattr(tc, n) for n in originals} == originals


def test_other_threads_keep_torchs_own_checkpoint() -> None:
    model = _stateful()
    results: dict[str, list[torch.Tensor]] = {}
    entered, done = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        results["other"] = _train(model, lambda m, x: tc.checkpoint(m, x, use_reentrant=False))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with patch_torch_checkpoint():
        entered.set()
        done.wait()
    thread.join()
    assert _equal(results["other"], _train(model, _torchs(use_reentrant=False)))  # BN twice


def test_decorator_form_and_enclosing_scope_settings() -> None:
    model = _stateful()

    @patch_torch_checkpoint()
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(m, x, use_reentrant=False)

    assert _equal(_train(model, step), _train(model, _plain))

    def disabled(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scopedckpt.checkpointing(enabled=False), patch_torch_checkpoint():
            return tc.checkpoint(m, x, use_reentrant=False)

    assert _equal(_train(model, disabled), _train(model, _torchs(use_reentrant=False)))
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match="strict mode found"),
        scopedckpt.checkpointing(strict=True),
        patch_torch_checkpoint(),
    ):
        tc.checkpoint(model, torch.randn(3, 6, requires_grad=True), use_reentrant=False)
