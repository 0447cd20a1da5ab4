"""The region mechanisms (NOTE [ region mechanisms ] in _mechanisms.py): one protocol, entered
in order, undone in reverse, and exception-safe at every step."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import scopedckpt
from scopedckpt.core import _engine, _mechanisms
from scopedckpt.core._state import FRAME, SCOPE, Frame, Phase, RegionCall, Tape
from scopedckpt.mechanisms import _guard


class Recorder:
    """A mechanism that logs its calls; raises where told."""

    FRAME_PHASES = frozenset({Phase.FORWARD, Phase.RECOMPUTE})

    def __init__(self, name: str, log: list[str], fail: str | None = None) -> None:
        self.name, self.log, self.fail = name, log, fail

    def start_region(self, tape: Tape, call: RegionCall) -> bool:
        self.log.append(f"start {self.name}")
        return True

    def enter_frame(self, frame: Frame) -> Callable[..., None] | None:
        self.log.append(f"enter {self.name} {frame.phase.name}")
        if self.fail == "enter":
            raise KeyError(self.name)

        def undo(*exc: object) -> None:
            self.log.append(f"undo {self.name}")
            if self.fail == "undo":
                raise ValueError(self.name)

        return undo


@pytest.fixture
def mechanisms(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., list[str]]]:
    """Put recorders around the real mechanisms: before them and after them."""
    log: list[str] = []

    def install(first: str | None = None, last: str | None = None) -> list[str]:
        before = Recorder("first", log, first)
        after = Recorder("last", log, last)
        monkeypatch.setattr(_mechanisms, "MECHANISMS", (before, *_mechanisms.MECHANISMS, after))
        return log

    yield install


def _nothing_active() -> None:
    assert SCOPE.get() is None and FRAME.get() is None
    assert not _guard.installed(), "the guard's global hooks outlived the frame"
    assert _get_current_dispatch_mode() is None, "a dispatch mode outlived the frame"


def _strict_region() -> torch.Tensor:
    """A region in which every core mechanism acts: strict mode, the RNG stash, the guard
    (an eval-mode batch norm's buffers), the memory report and selective saving."""
    block = nn.Sequential(
        nn.Linear(4, 4),
        scopedckpt.BatchNorm1d(4),
        nn.BatchNorm1d(4).eval(),
        scopedckpt.Dropout(0.3),
    )
    with (
        scopedckpt.memory_report(),
        scopedckpt.checkpointing(strict=True, save=[torch.ops.aten.addmm]),
    ):
        return scopedckpt.checkpoint(block, torch.randn(3, 4, requires_grad=True))


def test_every_mechanism_starts_and_enters_in_order_and_undoes_in_reverse(
    mechanisms: Callable[..., list[str]],
) -> None:
    log = mechanisms()
    _strict_region().sum().backward()
    assert log == [
        "start first",
        "start last",
        "enter first FORWARD",
        "enter last FORWARD",
        "undo last",
        "undo first",
        "enter first RECOMPUTE",
        "enter last RECOMPUTE",
        "undo last",
        "undo first",
    ]
    _nothing_active()


def test_a_mechanism_raising_on_entry_undoes_every_one_entered_before_it(
    mechanisms: Callable[..., list[str]],
) -> None:
    """The real ones (guard hooks, selective saving's mode) sit between the recorders."""
    log = mechanisms(last="enter")
    with pytest.raises(KeyError, match="last"):
        _strict_region()
    assert log[-2:] == ["enter last FORWARD", "undo first"]
    _nothing_active()


def test_an_undo_raising_still_runs_every_other_undo(
    mechanisms: Callable[..., list[str]],
) -> None:
    log = mechanisms(last="undo")
    with pytest.raises(ValueError, match="last"):
        _strict_region()
    assert log[-2:] == ["undo last", "undo first"]
    _nothing_active()


def test_each_mechanism_module_implements_the_protocol() -> None:
    for mechanism in _mechanisms.MECHANISMS:
        assert callable(mechanism.start_region) and callable(mechanism.enter_frame)
        assert mechanism.FRAME_PHASES <= {Phase.FORWARD, Phase.RECOMPUTE}
        first = (mechanism.__doc__ or "").strip()
        assert first, f"{mechanism.__name__} opens with no sentence saying what it owns"


def test_the_engine_names_no_mechanism_outside_its_registration() -> None:
    """The region path knows mechanisms only through MECHANISMS, which the mechanisms
    package fills: the engine names none of them."""
    engine = Path(_engine.__file__)
    names = {m.__name__.rsplit(".", 1)[1] for m in _mechanisms.MECHANISMS if hasattr(m, "__name__")}
    used: list[str] = []
    for node in ast.walk(ast.parse(engine.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in names:
                used.append(f"{node.value.id}.{node.attr}")
    assert used == []


# What each subpackage may import (besides itself): its layer and the ones below it.
_LAYERS = {
    "core": set(),
    "mechanisms": {"core"},
    "layers": {"core", "mechanisms"},
    "planner": {"core", "mechanisms", "policies"},
    "integrations": {"core", "mechanisms", "layers"},
    "testing": {"core", "mechanisms", "layers", "planner"},
}


def test_the_subpackages_depend_one_way() -> None:
    """No import circle between subpackages, not even under TYPE_CHECKING or inside a
    function: the core imports no mechanism (they register themselves), the mechanisms
    no layer, and nothing below the planner imports it."""
    root = Path(scopedckpt.__file__).parent
    wrong: list[str] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:
            continue
        package = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = list(parts[:-1])[: len(parts) - node.level]
            target = [*base, *(node.module.split(".") if node.module else [])]
            if node.module is None:  # from .. import policies
                target += [alias.name for alias in node.names]
            other = target[0] if target else ""
            if other != package and other not in _LAYERS[package]:
                wrong.append(f"{'/'.join(parts)}:{node.lineno} imports {'.'.join(target)}")
    assert wrong == []


def test_a_region_refused_at_its_start_leaves_no_report_row() -> None:
    """A name pattern needs a module region: selective saving refuses a function before
    the memory report, which starts last, makes its row."""
    x = torch.randn(3, 4, requires_grad=True)
    with scopedckpt.memory_report() as report:
        with pytest.raises(scopedckpt.ScopedCkptError, match="not a module"):
            with scopedckpt.checkpointing(save=["mlp.*"]):
                scopedckpt.checkpoint(torch.sin, x)
    assert report.rows == []
    _nothing_active()


def test_every_module_of_the_package_says_what_it_owns_and_stays_small() -> None:
    """Issue 24's shape: each module opens with a sentence, and none grows past about 400
    lines (split by concept when a feature grows one)."""
    package = Path(_engine.__file__).parent
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 410, f"{path.name}: split it by concept"
        assert ast.get_docstring(ast.parse(text)), f"{path.name} opens with no docstring"


# Each tape field a mechanism owns, and the modules of that mechanism (the buffer guard is
# two: its hooks, and what one guarded call keeps).
_OWNERS = {
    "rng": {"_rng"},
    "generators": {"_generators"},
    "world": {"_world"},
    "written": {"_written"},
    "hooks": {"_hooks"},
    "states": {"_guard", "_module_state"},
    "modes": {"_guard"},
    "saved": {"_selective"},
    "stats": {"_report"},
    "verifying": {"_verify"},
    "inputs": {"_inputs"},
}


def test_each_mechanism_keeps_its_state_to_itself() -> None:
    """Issue 40: no module reads or writes another mechanism's field of the tape; it calls
    the owner's function (``_rng.replays``, ``_selective.saves``, ``_report.stats_of``...)."""
    package = Path(_engine.__file__).parent.parent
    assert set(_OWNERS) | {"records", "forward_mechanisms", "recompute_mechanisms"} == {
        name for name in Tape.__dataclass_fields__
    }
    trespass = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in _OWNERS
                and path.stem not in _OWNERS[node.attr]
                and ast.unparse(node.value).split(".")[-1] == "tape"
            ):
                trespass.append(f"{path.relative_to(package)}:{node.lineno}: tape.{node.attr}")
    assert not trespass, trespass
