"""The public surface: every exported name imports and is documented."""

from __future__ import annotations

import inspect

import pytest

import scopedckpt
import scopedckpt.functional
import scopedckpt.policies
import scopedckpt.testing
import scopedckpt.testing.strategies

MODULES = [
    scopedckpt,
    scopedckpt.functional,
    scopedckpt.policies,
    scopedckpt.testing,
    scopedckpt.testing.strategies,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_is_sorted_and_every_name_has_a_docstring(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert list(names) == sorted(names)
    for name in names:
        obj = getattr(module, name)
        if inspect.ismodule(obj) or callable(obj) or inspect.isclass(obj):
            doc = inspect.getdoc(obj)
            assert doc and len(doc) > 20, f"{module.__name__}.{name} has no docstring"


def test_version_and_typed_marker() -> None:
    from importlib import resources

    assert scopedckpt.__version__ == "0.1.0"
    assert resources.files("scopedckpt").joinpath("py.typed").is_file()


def test_errors_share_one_root() -> None:
    assert issubclass(scopedckpt.ScopedCkptError, RuntimeError)
