"""checkpointing(): nesting, exceptions, threads, asyncio, decorator use."""

from __future__ import annotations

import asyncio
import contextvars
import re
import threading

import pytest
import torch

import scopedckpt
from scopedckpt.core._engine import COUNTERS


def _regions_made(fn) -> int:  # type: ignore[no-untyped-def]
    before = COUNTERS.regions
    fn()
    return COUNTERS.regions - before


def _one_region() -> None:
    scopedckpt.checkpoint(torch.sin, torch.ones(2, requires_grad=True))


def test_nested_enabled_false_turns_regions_off_and_back_on() -> None:
    with scopedckpt.checkpointing():
        assert _regions_made(_one_region) == 1
        with scopedckpt.checkpointing(enabled=False):
            assert _regions_made(_one_region) == 0
            with scopedckpt.checkpointing():
                assert _regions_made(_one_region) == 1
        assert _regions_made(_one_region) == 1
    assert _regions_made(_one_region) == 0


def test_exception_resets_the_scope() -> None:
    with pytest.raises(KeyError), scopedckpt.checkpointing():
        raise KeyError("x")
    assert _regions_made(_one_region) == 0


def test_same_object_can_be_entered_twice() -> None:
    scope = scopedckpt.checkpointing()
    with scope:
        with scope:
            assert _regions_made(_one_region) == 1
        assert _regions_made(_one_region) == 1
    assert _regions_made(_one_region) == 0


def test_decorator_enters_a_fresh_scope_per_call() -> None:
    @scopedckpt.checkpointing()
    def step() -> int:
        return _regions_made(_one_region)

    assert step() == 1
    assert _regions_made(_one_region) == 0


def test_plain_thread_does_not_see_the_scope_but_a_copied_context_does() -> None:
    results: dict[str, int] = {}
    with scopedckpt.checkpointing():
        context = contextvars.copy_context()
        plain = threading.Thread(target=lambda: results.update(plain=_regions_made(_one_region)))
        copied = threading.Thread(
            target=lambda: context.run(lambda: results.update(copied=_regions_made(_one_region)))
        )
        for t in (plain, copied):
            t.start()
            t.join()
    assert results == {"plain": 0, "copied": 1}


def test_asyncio_tasks_see_their_own_scopes() -> None:
    async def inside() -> int:
        with scopedckpt.checkpointing():
            await asyncio.sleep(0)
            return _regions_made(_one_region)

    async def outside() -> int:
        await asyncio.sleep(0)
        return _regions_made(_one_region)

    @scopedckpt.checkpointing()
    async def decorated() -> int:
        await asyncio.sleep(0)
        return _regions_made(_one_region)

    async def main() -> list[int]:
        return list(await asyncio.gather(inside(), outside(), decorated(), outside()))

    assert asyncio.run(main()) == [1, 0, 1, 0]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"enabled": 1},
            TypeError,
            "scopedckpt: checkpointing(enabled=...) must be a bool, got int.",
        ),
        (
            {"strict": "yes"},
            TypeError,
            "scopedckpt: checkpointing(strict=...) must be a bool or None, got str.",
        ),
        (
            {"root": 3},
            TypeError,
            "scopedckpt: checkpointing(root=...) must be an nn.Module, got int.",
        ),
    ],
)
def test_bad_flags_are_rejected(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        scopedckpt.checkpointing(**kwargs)


def test_bad_targets_are_rejected() -> None:
    with pytest.raises(
        TypeError, match=re.escape("scopedckpt: checkpointing target #0 is a bool;")
    ):
        scopedckpt.checkpointing(False)
    with pytest.raises(
        TypeError, match=re.escape("target #1 is the class int, which is not an nn.Module")
    ):
        scopedckpt.checkpointing(torch.nn.Linear, int)
    with pytest.raises(ValueError, match=re.escape("pass checkpointing(predicate, root=model)")):
        scopedckpt.checkpointing(lambda name, module: True)
