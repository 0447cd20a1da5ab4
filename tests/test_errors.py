"""Errors that name and teach: every ScopedCkptError a region can raise, without root=.

Each first line (up to the first newline) starts with ``scopedckpt:``, is at most 200
characters, says what happened, names the region by its module path (the key in the
``nn.ModuleList`` given to ``checkpointing()``, or the path in the model it was given)
or says how to get one, and gives the most likely fix; details follow on later lines.
"""

from __future__ import annotations

import re
import types
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scopedckpt
from scopedckpt.core import _names
from scopedckpt.core._light import RecomputeDivergenceError
from scopedckpt.planner._budget import format_bytes

from .test_guard import Placeholder
from .test_written import ClampsAChildsWeight

aten = torch.ops.aten

IN_LIST = "in the ModuleList given to checkpointing()"


class Net(nn.Module):
    """Three blocks in a ModuleList, the middle one given."""

    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), middle, nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _net(middle: nn.Module) -> Net:
    torch.manual_seed(0)
    return Net(middle)


def _x() -> torch.Tensor:
    return torch.randn(3, 4, requires_grad=True)


def _first_line(message: str) -> str:
    """Raise unless ``message``'s first line keeps the rules; return it."""
    line = message.split("\n", 1)[0]
    assert line.startswith("scopedckpt: "), line
    assert len(line) <= 200, f"{len(line)} characters: {line}"
    return line


def _exactly(line: str) -> str:
    """A ``match=`` for a message whose first line is ``line``, with details after it."""
    assert len(line) <= 200 and line.startswith("scopedckpt: "), line
    return "^" + re.escape(line) + "\n"


class _Tally:
    """State outside the modules' attributes: nothing replays it."""

    def __init__(self) -> None:
        self.calls = 0


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.tally = _Tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally.calls += 1
        return torch.tanh(self.linear(x) * self.tally.calls)


def test_a_failed_bitwise_verification_names_the_block_and_stateful() -> None:
    model = _net(Counts())
    with scopedckpt.checkpointing(model.blocks, determinism_check="bitwise"):
        loss = model(_x()).sum()
    line = (
        f"scopedckpt: bitwise verification failed in the forward of '1' {IN_LIST} (Counts): "
        "for state outside its modules (a global), implement scopedckpt.Stateful."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)) as error:
        loss.backward()
    assert "Saved tensor #" in str(error.value)  # the details follow


def _refused_in_forward(model: nn.Module, line: str) -> None:
    """``model``'s blocks as regions: its forward raises with first line ``line``."""
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model.blocks),
    ):
        model(_x())


def test_a_parameter_written_without_a_copy_names_the_block() -> None:
    model = _net(ClampsAChildsWeight())
    line = (
        f"scopedckpt: the forward of '1' {IN_LIST} (ClampsAChildsWeight) changed parameter "
        "'linear.weight' in place: make that change outside the region (before the step)."
    )
    _refused_in_forward(model, line)


class Drops(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5)


class DrawsFromItsOwn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(x.shape, generator=self.generator)


@pytest.mark.parametrize(
    ("block", "pattern"),
    [
        (Drops, r"scopedckpt: strict mode found the random op aten\.\S+ in region '1' "),
        (
            DrawsFromItsOwn,
            r"scopedckpt: strict mode found aten\.\S+ on its own generator in region '1' ",
        ),
    ],
    ids=["random op", "own generator"],
)
def test_strict_mode_names_the_random_op_and_the_block(
    block: type[nn.Module], pattern: str
) -> None:
    model = _net(block())
    with (
        pytest.raises(scopedckpt.ScopedCkptError) as error,
        scopedckpt.checkpointing(model.blocks, strict=True),
    ):
        model(_x())
    line = _first_line(str(error.value))
    fix = (
        "use a scoped layer with generator=g."
        if block is DrawsFromItsOwn
        else ("use a scoped layer or turn strict off.")
    )
    assert re.fullmatch(pattern + re.escape(f"{IN_LIST} ({block.__name__}): {fix}"), line), line


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_strict_mode_names_a_torch_layer_changing_its_buffers_by_its_path() -> None:
    model = _net(Normed())
    line = (
        f"scopedckpt: strict mode found '1.norm' {IN_LIST} (BatchNorm1d) changing buffers in "
        "a region: use a scoped layer or turn strict off."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model.blocks, strict=True),
    ):
        model(_x())


def test_save_selecting_an_in_place_op_names_the_op_and_the_block() -> None:
    model = _net(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)))
    line = (
        f"scopedckpt: save= selects aten.relu_.default in region '1' {IN_LIST} "
        "(Sequential), but that op changes its arguments in place: leave it out of the policy."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model.blocks, save=[aten.relu_]),
    ):
        model(_x())


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_save_patterns_on_a_function_region_say_to_checkpoint_a_module() -> None:
    line = (
        "scopedckpt: save= has name patterns ['0'], but the region _doubled is not a module: "
        "checkpoint a module, whose paths they match."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(save=["0"]),
    ):
        scopedckpt.checkpoint(_doubled, _x())


class Slices(nn.Module):
    """How many rows it reads is state nothing replays."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.rows = {"n": 2}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x[: self.rows["n"]]).relu()


def test_a_recompute_missing_a_kept_op_names_the_block() -> None:
    model = _net(Slices())
    with scopedckpt.checkpointing(model.blocks, save=[aten.addmm], determinism_check="none"):
        loss = model(_x()).sum()
    model.blocks[1].rows["n"] = 3
    line = (
        f"scopedckpt: the recompute of region '1' {IN_LIST} (Slices) did not run the ops "
        "whose outputs save= kept: move data-dependent branches out of it."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)):
        loss.backward()


def test_an_input_written_in_place_names_the_block_by_its_path_in_the_model() -> None:
    """The ModuleList is found in the model given too: the block's full path."""
    model = _net(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)))
    line = (
        "scopedckpt: the forward of 'blocks.1' (Sequential) changed its input (positional "
        "argument #0) in place: make that op out of place (inplace=False)."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model, model.blocks),
    ):
        model(_x())


def test_reentrant_checkpointing_is_refused_naming_the_block() -> None:
    model = _net(nn.Linear(4, 4))
    line = (
        f"scopedckpt: checkpoint(use_reentrant=True) of '1' {IN_LIST} (Linear) cannot be "
        "exact: pass use_reentrant=False, or leave it unset."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model.blocks),
    ):
        scopedckpt.checkpoint(model.blocks[1], _x(), use_reentrant=True)


class Swaps(nn.Module):
    """Calls its two scoped dropouts in an order set by state nothing replays."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = scopedckpt.Dropout(0.5), scopedckpt.Dropout(0.25)
        self.order = {"swapped": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.order["swapped"] else (self.a, self.b)
        return second(first(x))


def test_scoped_layers_called_in_another_order_name_the_block_and_the_layers() -> None:
    model = _net(Swaps())
    with scopedckpt.checkpointing(model.blocks):
        loss = model(_x()).sum()
    model.blocks[1].order["swapped"] = True
    line = (
        f"scopedckpt: the recompute of region '1' {IN_LIST} (Swaps) made its scoped calls "
        "in another order: move data-dependent branches out of it."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)) as error:
        loss.backward()
    assert f"Dropout(p=0.25, inplace=False) at '1.b' {IN_LIST}, but" in str(error.value)


class CallsTwice(nn.Module):
    """Calls ``layer`` once more where state nothing replays says so."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.linear = nn.Linear(4, 4)
        self.twice = {"now": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer(x)
        if self.twice["now"]:
            x = self.layer(x)
        return self.linear(x)


def test_more_scoped_calls_in_the_recompute_name_the_block() -> None:
    model = _net(CallsTwice(scopedckpt.Dropout(0.5)))
    with scopedckpt.checkpointing(model.blocks):
        loss = model(_x()).sum()
    model.blocks[1].twice["now"] = True
    line = (
        f"scopedckpt: the recompute of region '1' {IN_LIST} (CallsTwice) made more "
        "scoped calls than its first forward: move data-dependent branches out of it."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)):
        loss.backward()


def test_a_module_with_buffers_called_more_often_in_the_recompute_names_the_block() -> None:
    model = _net(CallsTwice(nn.BatchNorm1d(4)))
    with scopedckpt.checkpointing(model.blocks):
        loss = model(_x()).sum()
    model.blocks[1].twice["now"] = True
    line = (
        f"scopedckpt: bitwise verification failed in the forward of '1' {IN_LIST} "
        "(CallsTwice): for state outside its modules (a global), implement scopedckpt.Stateful."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)):
        loss.backward()


def test_a_lazy_module_first_called_in_a_region_names_it_and_the_fix() -> None:
    model = _net(nn.Sequential(nn.Linear(4, 4), Placeholder()))
    line = (
        f"scopedckpt: a lazy Placeholder was first called in region '1' {IN_LIST} "
        "(Sequential): call the model once outside checkpointing first."
    )
    _refused_in_forward(model, line)


class DrawsFirst(nn.Module):
    """Draws from torch's generator before its scoped dropout where state says so."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = scopedckpt.Dropout(0.5)
        self.draw = {"now": True}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.draw["now"]:
            torch.rand(1)
        return self.drop(x) * 2


def test_a_scoped_dropout_drawing_another_seed_names_the_block() -> None:
    model = _net(DrawsFirst())
    with scopedckpt.checkpointing(model.blocks):
        loss = model(_x()).sum()
    model.blocks[1].draw["now"] = False
    line = (
        f"scopedckpt: the recompute of region '1' {IN_LIST} (DrawsFirst) drew other random "
        "numbers than its first forward: give its scoped layers their own generator=..."
    )
    with pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)):
        loss.backward()


class Branches(nn.Module):
    """Takes a branch set by state nothing replays."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.deep = {"now": True}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y.tanh().tanh() if self.deep["now"] else y.tanh()


def test_a_recompute_taking_another_path_names_the_block() -> None:
    """The path check of every call (NOTE [ light check ]): its message is _light.py's,
    its region's name this module's."""
    model = _net(Branches())
    with scopedckpt.checkpointing(model.blocks, determinism_check="none"):
        loss = model(_x()).sum()
    model.blocks[1].deep["now"] = False
    with pytest.raises(RecomputeDivergenceError) as error:
        loss.backward()
    line = str(error.value).split("\n", 1)[0]
    assert line.startswith("scopedckpt: "), line
    assert f"the forward of '1' {IN_LIST} (Branches) took another path" in line, line


class DynamicCache:
    """Stands for transformers' cache: recognised by class name and module."""

    __module__ = "transformers.cache_utils"


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        return self.linear(x)


def test_a_hugging_face_cache_given_to_a_block_names_it_and_use_cache() -> None:
    model = _net(Cached())
    line = (
        f"scopedckpt: the forward of '1' {IN_LIST} (Cached) got a Hugging Face DynamicCache "
        "as keyword argument 'cache' in a region: pass use_cache=False while training."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(model.blocks),
    ):
        model.blocks[1](_x(), cache=DynamicCache())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.relu(x))


def test_a_class_targets_region_says_how_to_get_its_path() -> None:
    """An instance of a class target: no path without root=, and the message says so."""
    model = _net(Block())
    line = (
        "scopedckpt: the forward of a Block module (pass root=model to checkpointing() for "
        "its path) changed its input (positional argument #0) in place: make that op out of "
        "place (inplace=False)."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(Block),
    ):
        model(_x())
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=re.escape("'blocks.1' (Block)")),
        scopedckpt.checkpointing(Block, root=model),
    ):
        model(_x())


def _in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2)


def test_a_function_region_says_how_to_get_a_path() -> None:
    line = (
        "scopedckpt: _in_place (a function: checkpoint a module to name it by its path) "
        "changed its input (positional argument #0) in place: make that op out of place "
        "(inplace=False)."
    )
    with (
        pytest.raises(scopedckpt.ScopedCkptError, match=_exactly(line)),
        scopedckpt.checkpointing(),
    ):
        scopedckpt.checkpoint(_in_place, _x() * 1)


def test_a_single_model_target_names_its_modules_by_their_paths() -> None:
    model = _net(Normed())
    with (
        pytest.raises(scopedckpt.ScopedCkptError) as error,
        scopedckpt.checkpointing(model, strict=True),
    ):
        model(_x())
    line = _first_line(str(error.value))
    assert line.startswith("scopedckpt: strict mode found 'blocks.1.norm' (BatchNorm1d)"), line
    assert "in the region of the module given to checkpointing() (Net)" in str(error.value)


@pytest.mark.parametrize(
    ("word", "spoken"),
    [
        ("int", "an int"),
        ("Linear", "a Linear"),
        ("Embedding", "an Embedding"),
        ("LSTM", "an LSTM"),
        ("GRU", "a GRU"),
        ("RMSNorm", "an RMSNorm"),
        ("Upsample", "an Upsample"),
        ("UserDict", "a UserDict"),
        ("ModuleList", "a ModuleList"),
    ],
)
def test_type_names_take_the_article_they_are_spoken_with(word: str, spoken: str) -> None:
    assert _names.article(word) == spoken


def test_a_bad_target_reads_an_int() -> None:
    with pytest.raises(TypeError, match=re.escape("checkpointing target #0 is an int;")):
        scopedckpt.checkpointing(3)  # type: ignore[arg-type]


class RunsOutOfMemory(nn.Module):
    """Raises torch's out-of-memory error in the phase it is told (a global: the forward's
    world would put an attribute back for the recompute)."""

    phase: ClassVar[list[scopedckpt.Phase]] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if scopedckpt.phase() in RunsOutOfMemory.phase:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return self.linear(x).tanh()


@pytest.mark.parametrize("phase", ["first forward", "recompute (in backward)"])
def test_an_out_of_memory_error_in_a_region_says_where_in_a_note(phase: str) -> None:
    """torch's own error, its type and message unchanged, with one note naming the region
    in flight and its phase (the innermost region's: the enclosing one adds none)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(RunsOutOfMemory()), nn.Linear(4, 1))
    first = phase == "first forward"
    RunsOutOfMemory.phase = [scopedckpt.Phase.FORWARD if first else scopedckpt.Phase.RECOMPUTE]
    try:
        with (
            pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory") as error,
            scopedckpt.checkpointing(model[1], model[1][0], root=model),
        ):
            loss = model(_x()).sum()
            loss.backward()
    finally:
        RunsOutOfMemory.phase = []
    notes = error.value.__notes__
    assert len(notes) == 1
    assert notes[0].startswith(
        f"scopedckpt: out of memory in the {phase} of region '1.0' (RunsOutOfMemory)."
    )
    assert "scopedckpt.peak_report(step, root=model)" in notes[0]


def test_an_out_of_memory_error_in_a_planned_region_says_how_low_a_plan_goes() -> None:
    """Where plan() profiled the model, the note gives the smallest peak a plan of its
    blocks reaches, and the peak without checkpointing."""
    model = nn.Sequential(nn.Linear(4, 4), RunsOutOfMemory(), nn.Linear(4, 1))
    x = _x()
    plan = scopedckpt.plan(model, x, budget=1.0, blocks=[model[1]], loss_fn=lambda y: y.sum())
    RunsOutOfMemory.phase = [scopedckpt.Phase.FORWARD]
    try:
        with pytest.raises(torch.OutOfMemoryError) as error, scopedckpt.checkpointing(model[1]):
            model(x)
    finally:
        RunsOutOfMemory.phase = []
    (note,) = error.value.__notes__
    assert "scopedckpt.plan() profiled this model: no plan of its blocks peaks below " in note
    assert format_bytes(plan.smallest_budget) in note


class OutOfMemoryOutsideRegions(nn.Module):
    """Raises torch's out-of-memory error in its backward, outside any region, while armed."""

    armed: ClassVar[bool] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailsInBackward.apply(x)


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if not OutOfMemoryOutsideRegions.armed:
            return grad
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


def test_an_out_of_memory_error_outside_regions_in_a_memory_report_says_so_and_what_ran() -> None:
    """Raised in backward outside any region, inside a memory_report() block: one note names
    the block, the innermost line outside torch (the raise here; for torch's own error, the
    user's call into torch), the regions measured so far and, where plan() profiled the
    model, how low a plan goes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), OutOfMemoryOutsideRegions(), nn.Linear(4, 1))
    x = _x()
    plan = scopedckpt.plan(model, x, budget=1.0, blocks=[model[0]], loss_fn=lambda y: y.sum())
    OutOfMemoryOutsideRegions.armed = True
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory") as error:
            with scopedckpt.memory_report(root=model):
                with scopedckpt.checkpointing(model[0]):
                    loss = model(x).sum()
                loss.backward()
    finally:
        OutOfMemoryOutsideRegions.armed = False
    (note,) = error.value.__notes__
    del error  # its traceback holds the region, and with it the scope's patches
    first, *rest = note.splitlines()
    assert first.startswith(
        f"scopedckpt: out of memory in a memory_report() block, outside any region, at {__file__}:"
    )
    assert first.endswith(f"({_RAISE}).")
    assert rest[0] == "The regions it measured so far:" and rest[3].startswith("0 ")
    assert format_bytes(plan.smallest_budget) in note


_RAISE = 'raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")'


def _out_of_memory() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


# The same function, its code said to be torch's: an error raised inside torch.
_in_torch = types.FunctionType(
    _out_of_memory.__code__.replace(co_filename=torch.__file__), globals()
)


class RunsOutOfMemoryInTorch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _in_torch()  # the line the note names
        return x


def test_an_out_of_memory_error_outside_regions_in_a_scope_gets_one_note() -> None:
    """In a checkpointing() scope (the forward outside its regions), inside a memory_report()
    block too: the innermost block adds the note, once, naming the innermost line outside
    torch (the call into torch)."""
    model = nn.Sequential(nn.Linear(4, 4), RunsOutOfMemoryInTorch(), nn.Linear(4, 1))
    with pytest.raises(torch.OutOfMemoryError) as error, scopedckpt.memory_report():
        with scopedckpt.checkpointing(model[0], root=model):
            model(_x())
    (note,) = error.value.__notes__
    del error
    first = note.splitlines()[0]
    assert first.startswith("scopedckpt: out of memory in a checkpointing() scope, outside any")
    assert f"{__file__}:" in first and first.endswith("(_in_torch()  # the line the note names).")
