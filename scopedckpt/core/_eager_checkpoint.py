"""The eager region's checkpoint: torch's non-reentrant algorithm, less what the
mechanisms already do.

NOTE [ eager checkpoint ]
=========================
An eager region needs from torch's non-reentrant checkpoint only its saved-tensor
algorithm: the first forward hands autograd a placeholder for every tensor it
saves, and backward's first unpack recomputes the region under a second pair of
hooks that collects the recomputed tensors in the same order (stopping, with
early stop, once the last one is collected). Everything else torch's checkpoint
does around it per call is either done by scopedckpt's own mechanisms (RNG
replay: scopedckpt always passes ``preserve_rng_state=False``) or concerns paths
this one is not taken for (debug mode, a caller's ``context_fn``, tracing,
torch function modes). :func:`usable` says when it is taken; everywhere else
the region goes through ``torch.utils.checkpoint.checkpoint`` as before.

It keeps torch's contract, rule for rule (``torch/utils/checkpoint.py``, "Rule 1"
to "Rule 6"):

* inputs are saved as autograd saves tensors (``_make_saved_tensor``), so an
  enclosing region's hooks drop and recompute them too (nested regions);
* recomputed tensors are kept per graph task (``retain_graph=True``, then
  another backward, recomputes again), each released when backward unpacks
  it, and unpacking one twice raises torch's ``CheckpointError``;
* a placeholder autograd has already freed is not filled;
* the determinism check is torch's registry (``"default"``, ``"none"``, and
  scopedckpt's ``"bitwise"``), with torch's messages on a mismatch, and
  ``set_checkpoint_early_stop`` overrides ``early_stop`` as in torch;
* the recompute runs under the autocast state of the first forward, with grad
  on, outside dynamo (compiled autograd), and its hooks are marked as
  checkpoint-internal where torch marks its own (torch >= 2.14).

The placeholders are indices into per-frame lists, not the per-tensor handle
dictionaries torch keeps; that, and skipping the per-call work above, is the
whole difference (``benchmarks/small_models.py``). One consequence: a
recomputed tensor whose placeholder autograd frees without unpacking it (a
graph branch dropped after the recompute) is released with the region's last
placeholder, where torch releases it with its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from . import _light, _torch_private
from ._autocast import autocast_as, autocast_state, device_type
from ._options import RegionOptions
from ._own_ops import internal
from ._sampling import Site

__all__ = ["run", "usable"]

_DEBUG_TIP = (
    "\nTip: pass debug=True to the checkpoint call (or wrap the step in "
    "torch.utils.checkpoint.set_checkpoint_debug_enabled(True)): torch then lists the ops "
    "of the first forward and of the recompute."
)
_UNPACKED = object()  # a recomputed slot that backward has unpacked
_SUPPRESSED = object()  # run's result until its region's forward returns


def usable(options: RegionOptions) -> bool:
    """Whether an eager region with these options can run here (NOTE [ eager checkpoint ]):
    no caller's ``context_fn`` or ``respect_saved_tensors_hooks``, no torch function or
    dispatch mode active (a device context, a trace)."""
    return (
        options.caller_context_fn is None
        and options.respect_saved_tensors_hooks is None
        and not _torch_private.modes_active()
    )


class _Placeholder:
    """What autograd keeps for one saved tensor: its index in the region."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int) -> None:
        self.index = index


def _default_metadata(x: torch.Tensor) -> tuple[Any, ...]:
    return (x.shape, x.dtype, x.device)


class _Frame:
    """One region's first forward and its recomputes (per graph task)."""

    __slots__ = (
        "__weakref__",
        "args",
        "autocast",
        "counts",
        "early_stop",
        "fn",
        "forward_completed",
        "ignore_saved_mismatch",
        "kwargs",
        "metadata",
        "metadata_fn",
        "name",
        "placeholders",
        "printed",
        "recompute_context",
        "recomputed",
        "tail",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recompute_context: Any,
        metadata_fn: Callable[[torch.Tensor], Any] | None,
        early_stop: bool,
        name: Callable[[], str] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name  # the region's, for messages
        saved = _torch_private.make_saved_tensor
        # (saved as autograd saves a node's input, argument)
        self.args = [(True, saved(a)) if isinstance(a, torch.Tensor) else (False, a) for a in args]
        self.kwargs = kwargs
        self.recompute_context = recompute_context
        self.metadata_fn = metadata_fn
        override = _torch_private.early_stop_override()
        self.early_stop = early_stop if override is None else override
        self.autocast = autocast_state(device_type(args))
        self.placeholders: list[weakref.ReferenceType[_Placeholder]] = []
        self.metadata: list[Any] = []
        # graph task -> the recomputed tensor of each placeholder (None: not collected,
        # _UNPACKED: handed to backward)
        self.recomputed: dict[Any, list[Any]] = {}
        self.counts: dict[Any, int] = {}  # graph task -> tensors its recompute saved so far
        self.forward_completed = False
        self.ignore_saved_mismatch = False
        # NOTE [ light check ] in _light.py: the tail's index (-1: none); the fingerprints
        # the first forward (key None) and each recompute (per graph task) took, by index.
        self.tail = -1
        self.printed: dict[Any, dict[int, torch.Tensor]] = {}

    def recompute(self, key: Any) -> None:
        """Run the region again, collecting what its first forward saved."""
        slots = self.recomputed[key] = [None] * len(self.placeholders)
        self.counts[key] = 0
        args = [a.unpack() if saved else a for saved, a in self.args]
        try:
            with _torch_private.internal_hooks(_collector(weakref.ref(self), key), _identity):
                with torch.enable_grad():
                    self._rerun(args)
        except _torch_private.STOP_RECOMPUTATION:
            pass
        except BaseException:
            # A failed recompute is run again by the next unpack of its key (a later
            # backward in the same GraphExecGroup), as torch's is.
            del self.recomputed[key], self.counts[key]
            raise
        self._check(slots, self.counts.pop(key), self.printed.pop(key, None))

    @torch.compiler.disable
    def _rerun(self, args: list[Any]) -> None:
        # Compiled autograd must not trace the recompute: its saved tensors would not be
        # the first forward's (torch's Note: [compiled autograd and checkpoint unpack hook]).
        with autocast_as(self.autocast), self.recompute_context:
            self.fn(*args, **self.kwargs)

    def _check(self, slots: list[Any], count: int, printed: dict[int, Any] | None) -> None:
        if self.ignore_saved_mismatch:
            return
        if count != len(self.placeholders):
            self._fail()
            raise _light.diverged(self.name, len(self.placeholders), f"{count}")
        metadata_fn = self.metadata_fn
        if metadata_fn is None:
            return
        different = []
        for index, placeholder in enumerate(self.placeholders):
            if placeholder() is None:
                continue
            saved = self.metadata[index]
            recomputed = metadata_fn(slots[index])
            if saved != recomputed:
                different.append((index, saved, recomputed))
        if different:
            shown = _shown if metadata_fn is _default_metadata else _identity
            tensors = "".join(
                f"tensor at position {index}:\nsaved metadata: {shown(saved)}\n"
                f"recomputed metadata: {shown(recomputed)}\n"
                for index, saved, recomputed in different
            )
            raise CheckpointError(
                "torch.utils.checkpoint: Recomputed values for the following tensors "
                f"have different metadata than during the forward pass.\n{tensors}." + _DEBUG_TIP
            )
        if printed is not None:
            forward = self.printed[None]
            for index, recomputed in printed.items():
                if not torch.equal(recomputed, forward[index]):
                    self._fail()
                    x = slots[index]
                    raise _light.other_values(self.name, index, None if x is _UNPACKED else x)

    def _fail(self) -> None:
        """The step is lost: the recompute context lets go of what it holds (``fail``)."""
        fail = getattr(self.recompute_context, "fail", None)
        if fail is not None:
            fail()


def _collector(frame_ref: weakref.ReferenceType[_Frame], key: Any) -> Callable[[Any], Any]:
    """The recompute's pack hook. It holds its frame weakly: a graph the recompute builds
    may outlive the step (a tensor the forward stores on a module), and must not keep the
    region's function, contexts or recomputed tensors alive."""

    def pack(x: torch.Tensor) -> torch.Tensor:
        x = x.detach() if x.requires_grad else x
        frame = frame_ref()
        if frame is None:
            raise AssertionError("scopedckpt: a recompute outlived its region (a bug)")
        index = frame.counts[key]
        frame.counts[key] = index + 1
        placeholders = frame.placeholders
        if index >= len(placeholders):
            if not frame.forward_completed:
                # Backward inside the region's forward, without early stop (torch's rule).
                frame.ignore_saved_mismatch = True
                return x
            frame._fail()
            raise _light.diverged(frame.name, len(placeholders), "more")
        if placeholders[index]() is not None:
            frame.recomputed[key][index] = x
        if index >= frame.tail >= 0 and index in frame.printed[None]:  # NOTE [ light check ]
            frame.printed.setdefault(key, {})[index] = _fingerprint(x)
        if frame.early_stop and index + 1 == len(placeholders):
            raise _torch_private.STOP_RECOMPUTATION
        return x

    return pack


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """The light check's fingerprint of ``x``, as none of the region's ops."""
    if _torch_private.modes_active():  # a region's selective-saving mode numbers ops
        with internal():
            return _light.fingerprint(x)
    return _light.fingerprint(x)


def _shown(metadata: tuple[Any, ...]) -> dict[str, Any]:
    """:func:`_default_metadata` as torch's default check shows it."""
    return {"shape": metadata[0], "dtype": metadata[1], "device": metadata[2]}


def _identity(x: Any) -> Any:
    return x


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward_context: Any,
    recompute_context: Any,
    determinism_check: str,
    early_stop: bool,
    site: Site | None = None,
    name: Callable[[], str] | None = None,
) -> Any:
    """``fn(*args, **kwargs)`` as a non-reentrant checkpoint, its first forward inside
    ``forward_context`` and every recompute inside ``recompute_context``.

    ``site``: the region's, where the default check light-checks it (NOTE [ light
    check ]); ``name``: names the region in errors.

    Example
    -------
    >>> import contextlib, torch
    >>> from scopedckpt.core import _eager_checkpoint
    >>> x = torch.ones(3, requires_grad=True)
    >>> y = _eager_checkpoint.run(torch.sin, (x,), {}, contextlib.nullcontext(),
    ...                           contextlib.nullcontext(), "default", True)
    >>> y.sum().backward()
    >>> torch.equal(x.grad, torch.cos(x.detach()))
    True
    """
    if determinism_check == "default":
        metadata_fn: Callable[[torch.Tensor], Any] | None = _default_metadata
    elif determinism_check == "none":
        metadata_fn = None
    else:
        metadata_fn = _torch_private.determinism_check_fn(determinism_check)
    frame = _Frame(fn, args, kwargs, recompute_context, metadata_fn, early_stop, name)

    placeholders = frame.placeholders
    metadata = frame.metadata
    default = metadata_fn is _default_metadata
    # NOTE [ light check ]: the tail's index where this call checks it, else -1; whether
    # this call learns it for its site (the last saved tensor that can be one).
    tail = -1
    learning = site is not None and site.tail is None
    if site is not None and default and not learning:
        tail = frame.tail = site.tail  # type: ignore[assignment]  # an int here
        if tail >= 0:
            printed = frame.printed[None] = {}
    learned = -1

    def pack(x: torch.Tensor) -> _Placeholder:
        nonlocal learned
        index = len(placeholders)
        placeholder = _Placeholder(index)
        placeholders.append(weakref.ref(placeholder))
        if default:
            metadata.append((x.shape, x.dtype, x.device))  # _default_metadata, inlined
        elif metadata_fn is not None:
            # Through ``frame``, a variable of this hook by that name, as in torch's: a
            # check may turn early stop off from inside (NOTE [ late writes ]).
            with torch.no_grad():
                metadata.append(frame.metadata_fn(x))  # type: ignore[misc]  # not None here
        if index >= tail >= 0 and _light.is_tail(x):  # the site's calls may differ
            printed[index] = _fingerprint(x)
        elif learning and _light.is_tail(x):
            learned = index
        return placeholder

    def unpack(placeholder: _Placeholder) -> torch.Tensor:
        key = _torch_private.graph_task_key()
        slots = frame.recomputed.get(key)
        if slots is None:
            frame.recompute(key)
            slots = frame.recomputed[key]
        tensor = slots[placeholder.index]
        if tensor is _UNPACKED:
            raise CheckpointError(
                "torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
                "already unpacked once. If you are calling ctx.saved_tensors in backward, "
                "make sure to do so only once. Otherwise please open an issue with details "
                "on your use case."
            )
        slots[placeholder.index] = _UNPACKED
        return tensor

    result: Any = _SUPPRESSED
    with _torch_private.internal_hooks(pack, unpack), forward_context:
        result = fn(*args, **kwargs)
    if result is _SUPPRESSED:  # the forward context suppressed fn's error: torch refuses that too
        raise RuntimeError(
            "torch.utils.checkpoint: the forward context provided by context_fn suppressed "
            "an exception raised during the checkpointed forward. This is not supported "
            "because checkpoint cannot return a value for a failed forward."
        )
    frame.forward_completed = True
    if learning:
        site.tail = learned  # type: ignore[union-attr]  # learning: a site
    elif tail >= 0 and not printed:
        frame.tail = -1  # this call saved fewer tensors: the count check names it
    return result
