"""Which regions recompute whole: layers whose ops save a tensor before writing it.

NOTE [ late writes ]
====================
``rrelu_with_noise`` (``nn.RReLU`` in training) hands autograd its noise tensor
before its kernel writes it, and torch's early stop ends a recompute inside the
op that packs the last tensor backward needs: when that is the noise, backward
reads memory the recompute never wrote (issue 25, hole 1; torch's checkpoint
has the same bug). A region over a module whose subtree holds such a layer in
training mode is recomputed without early stop, whole (:func:`full_recompute`):
exact, at the cost of the ops after its last saved tensor. The functional form
(``F.rrelu`` outside these layers) is not seen here; sampled verification
catches it (NOTE [ sampled verification ] in ``_sampling.py``), and
``early_stop=False`` makes it exact.
"""

from __future__ import annotations

from torch import nn

from ._subtree import subtree

__all__ = ["full_recompute"]


def full_recompute(module: nn.Module) -> bool:
    """Whether a region over ``module`` must recompute whole (NOTE [ late writes ])."""
    return any(layer.training for layer in subtree(module)[2])
