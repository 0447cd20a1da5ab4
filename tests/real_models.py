"""Third-party model families for tests/test_real_models.py, skipped where a package is missing.

The builders live in ``benchmarks/real_families.py`` (how timm is imported without
torchvision: ``benchmarks/real_imports.py``), shared with ``python -m
benchmarks.real_models`` so that the benchmark's table and these tests cover the same
models. Here each builder's ``UnavailableError`` becomes a :func:`pytest.skip` with its
message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks import real_families
from benchmarks.real_families import Built
from benchmarks.real_imports import REAL_EXTRA, UnavailableError

__all__ = ["FAMILIES", "REAL_EXTRA", "Built", "_convert", "hf_gpt2"]


def _skipping(build: Callable[..., Built]) -> Callable[..., Built]:
    """``build``, skipping the test when its package is missing."""

    @functools.wraps(build)
    def built(*args: Any, **kwargs: Any) -> Built:
        try:
            return build(*args, **kwargs)
        except UnavailableError as missing:
            pytest.skip(str(missing))

    return built


FAMILIES: dict[str, Callable[[], Built]] = {
    name: _skipping(build) for name, build in real_families.FAMILIES.items()
}
hf_gpt2 = _skipping(real_families.hf_gpt2)
_convert = real_families.convert_quietly
