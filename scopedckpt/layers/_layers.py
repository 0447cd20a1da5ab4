"""Scoped layers: torch's dropout and batch-norm layers that replay recomputes.

Each class subclasses its torch counterpart, so ``isinstance``, ``repr``,
constructor arguments and ``state_dict`` keys are unchanged. Outside checkpoint
regions they compute what their parents compute (dropout draws its mask from
a per-call seed, see :mod:`scopedckpt.functional`). Inside a region's backward
recompute dropout replays the first forward's mask and batch norm normalises
with the same batch statistics without touching ``running_mean``,
``running_var`` or ``num_batches_tracked``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core._own_ops import internal
from ..core._paths import EAGER, GRAPH, where
from ..core._replay import tape_value
from ..core._state import RECOMPUTE
from ..core._subtree import self_guarded
from ..core._torch_private import BatchNormBase, DropoutBase, check_input_dim
from ..mechanisms._verify import not_verified
from . import _dropout

__all__ = [
    "AlphaDropout",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "FeatureAlphaDropout",
]


class _ScopedDropout(DropoutBase):
    """Shared constructor and forward of the scoped dropout layers."""

    _kind: str  # the name of torch's functional counterpart, e.g. "dropout2d"
    generator: torch.Generator | None
    save_mask: bool

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        generator: torch.Generator | None = None,
        save_mask: bool = True,
    ) -> None:
        name = type(self).__name__
        p = _dropout.check_p(p, name)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"scopedckpt: {name}(generator=...) must be a torch.Generator or None, got "
                f"{type(generator).__name__}. Pass generator=torch.Generator().manual_seed(0)."
            )
        super().__init__(p, inplace)
        self.generator = generator
        self.save_mask = bool(save_mask)

    def forward(self, input: Tensor) -> Tensor:
        inplace = self.inplace and "alpha" not in self._kind  # as torch's alpha dropouts
        return _dropout.scoped_dropout(
            self._kind, input, self.p, self.training, inplace, self.generator, self.save_mask, self
        )


_DROPOUT_DOC = """{summary}

    The scoped counterpart of :class:`torch.nn.{name}` (and an instance of it).
    In training each call draws one seed, from ``generator`` if given or else
    from torch's default CPU generator, and builds its mask from it; inside a
    checkpoint region the backward recompute rebuilds the identical mask from
    the recorded seed. In eval mode it is the identity, as in torch.

    Parameters
    ----------
    p
        Probability of zeroing {unit}, in ``[0, 1]``.
    inplace
        Write the result into the input{inplace_note}.
    generator
        Draw seeds from this generator instead of the default CPU generator.
    save_mask
        Keep a one-byte-per-element mask for backward (default; channel-wise
        dropout keeps its float noise, one value per channel) or only the seed,
        rebuilding the mask in backward (no memory, one more random pass).

    Raises
    ------
    ValueError
        If ``p`` is outside ``[0, 1]``.

    Example
    -------
    >>> import torch, scopedckpt
    >>> layer = scopedckpt.{name}(p=0.5)
    >>> isinstance(layer, torch.nn.{name})
    True
    >>> layer
    {name}(p=0.5, inplace=False)
    >>> layer(torch.ones({shape})).shape
    torch.Size([{shape}])
"""


def _dropout_doc(name: str, summary: str, shape: str) -> str:
    """The docstring of the scoped layer ``name``, with an Example on ``torch.ones(shape)``."""
    return _DROPOUT_DOC.format(
        name=name,
        summary=summary,
        unit="an element" if name in ("Dropout", "AlphaDropout") else "a channel",
        shape=shape,
        inplace_note=" (ignored, as in torch)" if "Alpha" in name else "",
    )


class Dropout(_ScopedDropout, nn.Dropout):
    __doc__ = _dropout_doc(
        "Dropout", "Zero elements with probability ``p``, scaling the rest by ``1/(1-p)``.", "2, 3"
    )
    _kind = "dropout"


class Dropout1d(_ScopedDropout, nn.Dropout1d):
    __doc__ = _dropout_doc(
        "Dropout1d", "Zero whole channels of ``(N, C, L)`` or ``(C, L)`` input.", "2, 3, 4"
    )
    _kind = "dropout1d"


class Dropout2d(_ScopedDropout, nn.Dropout2d):
    __doc__ = _dropout_doc(
        "Dropout2d", "Zero whole channels of ``(N, C, H, W)`` input.", "2, 3, 4, 4"
    )
    _kind = "dropout2d"


class Dropout3d(_ScopedDropout, nn.Dropout3d):
    __doc__ = _dropout_doc(
        "Dropout3d",
        "Zero whole channels of ``(N, C, D, H, W)`` or ``(C, D, H, W)`` input.",
        "2, 3, 2, 2, 2",
    )
    _kind = "dropout3d"


class AlphaDropout(_ScopedDropout, nn.AlphaDropout):
    __doc__ = _dropout_doc(
        "AlphaDropout", "Alpha dropout: keeps SELU's zero mean and unit variance.", "2, 3"
    )
    _kind = "alpha_dropout"


class FeatureAlphaDropout(_ScopedDropout, nn.FeatureAlphaDropout):
    __doc__ = _dropout_doc("FeatureAlphaDropout", "Alpha dropout of whole channels.", "2, 3, 4")
    _kind = "feature_alpha_dropout"


class _ScopedBatchNorm(BatchNormBase):
    """Shared forward of the scoped batch-norm layers."""

    @self_guarded  # its own recompute path: the buffer guard skips it (NOTE [ buffer guard ])
    def forward(self, input: Tensor) -> Tensor:
        here = where()
        if here is EAGER:
            return self._scoped_forward(input)
        if here is GRAPH:
            # torch's checkpoint operator updates the statistics once by
            # itself (NOTE [ torch.compile ] in _compiled.py).
            return super().forward(input)
        return self._scoped_forward_outside_dynamo(input)

    def _scoped_forward(self, input: Tensor) -> Tensor:
        training, phase = tape_value("batch_norm", self, lambda: self.training)
        if phase is not RECOMPUTE:
            return super().forward(input)
        # Recompute: the same kernel on the same input as the first forward, so
        # the same bits and the same saved tensors (torch checks their number
        # and shapes), but the running buffers it would update are throwaway
        # copies, so running_mean, running_var and num_batches_tracked stay put.
        check_input_dim(self, input)
        running_mean, running_var = self.running_mean, self.running_var
        if training and self.track_running_stats and running_mean is not None:
            with internal():  # recompute-only ops: not numbered by selective saving
                running_mean = running_mean.clone()
                running_var = None if running_var is None else running_var.clone()
            # Saved, unread by backward in training, and not the first forward's values:
            # not compared by bitwise verification.
            not_verified(running_mean, running_var)
        elif training:
            running_mean = running_var = None
        batch_stats = training or (running_mean is None and running_var is None)
        momentum = 0.0 if self.momentum is None else self.momentum
        return F.batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            batch_stats,
            momentum,
            self.eps,
        )

    @torch.compiler.disable  # reads the region's tape: compiled code calls it behind a break
    def _scoped_forward_outside_dynamo(self, input: Tensor) -> Tensor:
        return self._scoped_forward(input)


_BN_DOC = """Batch normalisation over {what}, updating running statistics once per step.

    The scoped counterpart of :class:`torch.nn.{name}` (and an instance of it),
    with the same arguments, buffers and ``state_dict`` keys. Outside a
    checkpoint region's recompute it is exactly torch's layer. In the backward
    recompute it normalises with the same batch statistics (or, in eval mode,
    the same running statistics) and does not update ``running_mean``,
    ``running_var`` or ``num_batches_tracked``, also with ``momentum=None``.

    Example
    -------
    >>> import torch, scopedckpt
    >>> bn = scopedckpt.{name}(3)
    >>> x = torch.randn({shape}, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(bn, x)
    >>> y.square().sum().backward()
    >>> int(bn.num_batches_tracked)
    1
"""


class BatchNorm1d(_ScopedBatchNorm, nn.BatchNorm1d):
    __doc__ = _BN_DOC.format(name="BatchNorm1d", what="``(N, C)`` or ``(N, C, L)``", shape="4, 3")


class BatchNorm2d(_ScopedBatchNorm, nn.BatchNorm2d):
    __doc__ = _BN_DOC.format(name="BatchNorm2d", what="``(N, C, H, W)``", shape="4, 3, 2, 2")


class BatchNorm3d(_ScopedBatchNorm, nn.BatchNorm3d):
    __doc__ = _BN_DOC.format(name="BatchNorm3d", what="``(N, C, D, H, W)``", shape="4, 3, 2, 2, 2")
