"""Run training steps on a model and leave no trace: parameters, gradients, buffers,
module attributes and random streams are, bit for bit, what they were before.

NOTE [ leaving no trace ]
=========================
``plan()`` runs steps of the user's model to measure them; afterwards nothing
may differ, or the plan would change the training it plans. On entry
:class:`Untouched` keeps the gradients' objects (and sets them to None, as a
step after ``zero_grad()`` finds them), clones the buffers, keeps a shallow
copy of every module's attributes (a call counter, a warm-up switch, the
training flag), and saves the global random states (CPU, every CUDA device
once CUDA is initialized, Python's ``random``, NumPy's where imported).
Parameters are not cloned up front (a model's parameters may be most of its
memory): :meth:`Untouched.before_op`, called before every op by the counting
mode, clones a parameter before the first op that writes it in place (an
embedding's ``max_norm`` renormalization) and a generator's state before the
first op that draws from it. On exit every object is put back in its slot
(parameters, buffers and gradients assigned anew included) and every clone
that differs from its tensor is copied back: compared, because version
counters miss writes to optional arguments (batch norm's running statistics).
A parameter whose version counter moved with no clone taken (written where no
op was seen) cannot be put back: that raises.
"""

from __future__ import annotations

import random
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..core._errors import ScopedCkptError
from ..core._torch_private import module_buffers, module_parameters, version_of, written_positions
from ..mechanisms._world import numpy_random

__all__ = ["Untouched"]


class Untouched:
    """Put a model, its inputs' gradients and the random streams back on exit.

    Parameters
    ----------
    model
        The model the steps run.
    inputs
        Tensors the steps take; the gradients of leaves among them are put back.

    Example
    -------
    >>> import torch
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> with Untouched(bn, ()):
    ...     _ = bn(torch.randn(4, 3))
    >>> int(bn.num_batches_tracked)
    0
    """

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...]) -> None:
        self.model = model
        self.inputs = tuple(t for t in inputs if isinstance(t, torch.Tensor))
        self._slots: list[tuple[dict[str, Any], str, Any]] = []
        self._versions: dict[int, tuple[torch.Tensor, int, str]] = {}
        self._clones: dict[int, torch.Tensor] = {}
        self._parameter_storages: dict[int, torch.Tensor] = {}  # by id of their storage
        self._generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._written: dict[Any, tuple[tuple[int, str, bool], ...]] = {}  # by op

    def __enter__(self) -> Untouched:
        for prefix, module in self.model.named_modules(remove_duplicate=True):
            for kind, slots in (
                ("parameter", module_parameters(module)),
                ("buffer", module_buffers(module)),
            ):
                for name, tensor in slots.items():
                    self._slots.append((slots, name, tensor))
                    if tensor is None or id(tensor) in self._versions:
                        continue
                    qualified = f"{prefix}.{name}" if prefix else name
                    self._versions[id(tensor)] = (tensor, version_of(tensor), qualified)
                    if kind == "buffer":
                        self._clones[id(tensor)] = tensor.detach().clone()
                    else:
                        self._parameter_storages[id(tensor.untyped_storage())] = tensor
        self._leaves: list[torch.Tensor] = [*self.model.parameters()]  # + inputs taking grads
        self._leaves += [t for t in self.inputs if t.is_leaf and t.requires_grad]
        self._grads = [(tensor, tensor.grad) for tensor in self._leaves]
        self.clear_grads()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda)
        self._attributes = [(vars(m), dict(vars(m))) for m in self.model.modules()]
        self._python = random.getstate()
        numpy = numpy_random()
        self._numpy = None if numpy is None else (numpy, numpy.get_state())
        return self

    def clear_grads(self) -> None:
        """Gradients to None, as a step after ``zero_grad()`` finds them (put back on exit)."""
        for tensor in self._leaves:
            tensor.grad = None

    def before_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep what ``func`` is about to change: a parameter it writes in place, the
        state of a generator it draws from (see NOTE [ leaving no trace ])."""
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and id(generator) not in self._generators:
            self._generators[id(generator)] = (generator, generator.get_state())
        positions = self._written.get(func)
        if positions is None:
            positions = self._written[func] = written_positions(func)
        for index, name, keyword in positions:
            value = kwargs.get(name) if keyword or index >= len(args) else args[index]
            if not isinstance(value, torch.Tensor):
                continue
            parameter = self._parameter_storages.get(id(value.untyped_storage()))
            if parameter is not None and id(parameter) not in self._clones:
                self._clones[id(parameter)] = parameter.detach().clone()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for attributes, before in self._attributes:
            for name in [name for name in attributes if name not in before]:
                del attributes[name]
            for name, value in before.items():
                if attributes.get(name) is not value:
                    attributes[name] = value
        for slots, name, tensor in self._slots:
            slots[name] = tensor
        lost = []
        with torch.no_grad():
            for key, (tensor, version, name) in self._versions.items():
                clone = self._clones.get(key)
                if clone is not None:
                    # Compared, not trusted to version counters: kernels writing an
                    # optional argument (batch norm's running stats) leave them alone.
                    if not torch.equal(tensor, clone):
                        tensor.copy_(clone)
                elif version_of(tensor) != version:
                    lost.append(name)
        for tensor, grad in self._grads:
            tensor.grad = grad
        for generator, state in self._generators.values():
            generator.set_state(state)
        random.setstate(self._python)
        if self._numpy is not None:
            self._numpy[0].set_state(self._numpy[1])
        torch.set_rng_state(self._rng[0])
        if self._rng[1] is not None:
            torch.cuda.set_rng_state_all(self._rng[1])
        if lost and exc_type is None:
            raise ScopedCkptError(
                f"scopedckpt: plan() could not put back parameter(s) {', '.join(lost)}: they "
                "were changed in place where no op was seen (outside torch's dispatcher, or "
                "only in the timed step). Plan on a copy of the model "
                "(copy.deepcopy(model)) and apply the plan to the original."
            )
