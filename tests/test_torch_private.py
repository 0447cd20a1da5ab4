"""Fail loudly if torch changes what scopedckpt relies on (see _torch_private.py)."""

from __future__ import annotations

import inspect

import torch
import torch.utils.checkpoint as tc

from scopedckpt import _torch_private


def test_torch_dispatch_mode_still_sees_random_aten_ops_with_their_tag() -> None:
    seen: list[object] = []

    class Spy(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.nn.functional.dropout(torch.ones(4), 0.5)
        torch.rand(2)
    random_ops = [f for f in seen if torch.Tag.nondeterministic_seeded in f.tags]  # type: ignore[attr-defined]
    assert random_ops, f"no op tagged nondeterministic_seeded among {seen}"


def test_public_checkpoint_api_still_takes_the_arguments_we_pass() -> None:
    params = inspect.signature(tc.checkpoint).parameters
    for name in ("use_reentrant", "context_fn", "determinism_check", "early_stop"):
        assert name in params, f"torch.utils.checkpoint.checkpoint lost {name}"
    assert "preserve_rng_state" in inspect.getsource(tc.checkpoint)
