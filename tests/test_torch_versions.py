"""The torch-version layer (NOTE [ torch versions ] in _torch_private.py): torch's
checkpoint call path as detected here, and every private hook raising instead of
silently giving torch's checkpoint back on a torch that changed it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import re
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import scopedckpt
from scopedckpt.core import _patch, _torch_private, _torch_support
from scopedckpt.core._engine import COUNTERS
from scopedckpt.core._state import FRAME, SCOPE
from scopedckpt.core._torch_private import PATH
from scopedckpt.integrations import patch_torch_checkpoint

SPLIT_ONLY = pytest.mark.skipif(not PATH.split, reason="torch <= 2.13 has one checkpoint front")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.4), nn.Linear(6, 6))


def _step(model: nn.Module, run: Any) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    torch.manual_seed(1)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7), requires_grad=True)
    run(model, x).square().sum().backward()
    return [x.grad, *(p.grad for p in model.parameters()), *model.buffers()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _patched_region(call: Any) -> Any:
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        before = COUNTERS.regions
        with patch_torch_checkpoint():
            out = call(model, x)
        assert COUNTERS.regions == before + 1, "torch's checkpoint was not made a region"
        return out

    return run


@pytest.mark.parametrize("version", ["2.12.1+cu130", "2.4.0", "1.13.1"])
def test_a_torch_older_than_the_oldest_tested_is_refused_at_import(version: str) -> None:
    with pytest.raises(ImportError, match=r"needs torch >= 2\.13.*" + re.escape(version)):
        _torch_support.check_torch(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0", "3.0.0a0"])
def test_tested_and_newer_torch_is_accepted(version: str) -> None:
    _torch_support.check_torch(version)


def test_the_detected_path_is_the_one_this_torch_calls() -> None:
    split = hasattr(tc, "_checkpoint_impl")
    assert PATH.split is split
    assert PATH.generator == (
        "_checkpoint_without_reentrant_generator_impl"
        if split
        else "_checkpoint_without_reentrant_generator"
    )
    assert PATH.front == ("_checkpoint_impl" if split else "checkpoint")
    assert callable(getattr(tc, PATH.generator)) and callable(getattr(tc, PATH.front))
    assert callable(getattr(tc, PATH.reentrant).apply)
    with patch_torch_checkpoint():  # proves itself live on this torch
        pass


@SPLIT_ONLY
@pytest.mark.parametrize("reentrant", [False, None], ids=["False", "unset"])
def test_the_decorator_form_is_an_exact_region(reentrant: bool | None) -> None:
    def call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(use_reentrant=reentrant)(model)(x)

    model = _model()
    assert _same(_step(model, _patched_region(call)), _step(model, lambda m, x: m(x)))


@SPLIT_ONLY
def test_a_name_bound_before_the_patch_with_use_reentrant_unset_is_a_region() -> None:
    stored = functools.partial(tc.checkpoint)  # Hugging Face stores a partial at enable time
    model = _model()
    assert _same(_step(model, _patched_region(stored)), _step(model, lambda m, x: m(x)))


@pytest.mark.skipif(not PATH.respects_hooks, reason="torch < 2.14 has no such keyword")
def test_respect_saved_tensors_hooks_goes_to_torch_not_to_fn() -> None:
    def fn(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        assert not kwargs, kwargs
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with scopedckpt.checkpointing():
        scopedckpt.checkpoint(fn, x, respect_saved_tensors_hooks=False).sum().backward()
    model = _model()

    def call(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(m, y, use_reentrant=False, respect_saved_tensors_hooks=True)

    assert _same(_step(model, _patched_region(call)), _step(model, lambda m, y: m(y)))


@pytest.mark.skipif(PATH.respects_hooks, reason="this torch takes the keyword")
def test_respect_saved_tensors_hooks_is_refused_where_torch_lacks_it() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"needs torch >= 2\.14"), scopedckpt.checkpointing():
        scopedckpt.checkpoint(torch.sin, x, respect_saved_tensors_hooks=False)


def _assert_unpatched(originals: dict[str, Any]) -> None:
    assert {name: getattr(tc, name) for name in originals} == originals
    assert not _patch._ORIGINALS and _patch._USERS == 0


def test_a_torch_without_the_generator_raises_naming_version_and_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_patch, "PATH", dataclasses.replace(PATH, generator=None))
    originals = {"checkpoint": tc.checkpoint, PATH.reentrant: getattr(tc, PATH.reentrant)}
    with pytest.raises(scopedckpt.ScopedCkptError) as error, patch_torch_checkpoint():
        pass
    message = str(error.value)
    assert torch.__version__ in message and "non-reentrant generator" in message
    assert "scopedckpt.checkpoint" in message  # what to do
    _assert_unpatched(originals)


def test_a_torch_whose_checkpoint_no_longer_reaches_the_patched_names_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch renames its generator again: the old name exists (as 2.14 kept the old one)
    but nothing calls it any more. The patch must see that its swap is not live."""

    def renamed(function: Any, *args: Any, use_reentrant: Any = None, **kwargs: Any) -> Any:
        return function(*args, **kwargs)  # stands for torch calling a name we do not know

    def renamed_front(function: Any, args: Any, kwargs: Any, **options: Any) -> Any:
        return function(*args, **kwargs)

    if PATH.split:
        monkeypatch.setattr(tc, PATH.front, renamed_front)
    else:
        monkeypatch.setattr(tc, "checkpoint", renamed)
    names = {PATH.front, PATH.generator, PATH.reentrant, "checkpoint", "checkpoint_sequential"}
    originals = {name: getattr(tc, name) for name in names}
    with pytest.raises(scopedckpt.ScopedCkptError) as error, patch_torch_checkpoint():
        pytest.fail("the patch opened although torch's checkpoint does not reach it")
    message = str(error.value)
    assert torch.__version__ in message
    assert f"torch.utils.checkpoint.{PATH.generator} (called as use_reentrant=False)" in message
    _assert_unpatched(originals)
    monkeypatch.undo()
    with patch_torch_checkpoint():  # the real torch still works afterwards
        pass


def test_debug_mode_swaps_torchs_debug_hook_only_while_used() -> None:
    torchs = tc._get_debug_context_and_cb
    model = _model()

    def ours(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scopedckpt.checkpointing():
            return scopedckpt.checkpoint(m, x, debug=True)

    def swapped_inside(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with _torch_private.debug_composed(tc.noop_context_fn):
            assert tc._get_debug_context_and_cb is not torchs
            return tc.checkpoint(m, x, use_reentrant=False, debug=True)

    assert _same(_step(model, ours), _step(model, lambda m, x: m(x)))
    assert tc._get_debug_context_and_cb is torchs
    _step(model, swapped_inside)
    assert tc._get_debug_context_and_cb is torchs


def test_a_debug_region_torch_did_not_ask_for_raises() -> None:
    torchs = tc._get_debug_context_and_cb
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match="_get_debug_context_and_cb"),
        _torch_private.debug_composed(tc.noop_context_fn),
    ):
        pass  # a torch whose debug checkpoint builds its context some other way
    assert tc._get_debug_context_and_cb is torchs


@pytest.mark.parametrize("patched", [False, True], ids=["scopedckpt", "patched-torch"])
def test_an_exception_in_a_region_leaves_nothing_active(patched: bool) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("boom")

    block = nn.Sequential(nn.BatchNorm1d(3), Boom())
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(KeyError):
        if patched:
            with scopedckpt.checkpointing(), patch_torch_checkpoint():
                tc.checkpoint(block, x, use_reentrant=False)
        else:
            with scopedckpt.checkpointing(block):
                block(x)
    assert SCOPE.get() is None and FRAME.get() is None  # before any garbage collection
    gc.collect()
    assert SCOPE.get() is None and FRAME.get() is None
