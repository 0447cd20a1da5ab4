"""Every mutant in tests/mutations/mutate.py still finds its code: a moved anchor would
silently disarm it (the mutants themselves run by hand, ``python tests/mutations/mutate.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MUTATE = Path(__file__).resolve().parent / "mutations" / "mutate.py"


def test_each_mutation_anchor_is_found_exactly_once() -> None:
    spec = importlib.util.spec_from_file_location("scopedckpt_mutate", MUTATE)
    assert spec is not None and spec.loader is not None
    mutate = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutate  # dataclasses look their module up while being made
    try:
        spec.loader.exec_module(mutate)
        assert mutate.MUTANTS
        assert mutate._check_anchors(mutate.MUTANTS) == []
        names = [m.name for m in mutate.MUTANTS]
        assert len(names) == len(set(names)), "two mutants share a name"
    finally:
        del sys.modules[spec.name]
