"""Which regions recompute whole: those whose ops save a tensor before writing it.

NOTE [ late writes ]
====================
``rrelu_with_noise`` (``nn.RReLU`` and ``F.rrelu`` in training) hands autograd
its noise tensor before its kernel writes it, and torch's early stop ends a
recompute inside the op that packs the last tensor backward needs: when that
is the noise, backward reads memory the recompute never wrote (issue 25, hole
1; torch's checkpoint has the same bug). Such regions are recomputed without
early stop, whole (:func:`full_recompute`): exact, at the cost of the ops after
their last saved tensor. Found two ways:

* a region over a module whose subtree holds an ``nn.RReLU`` in training
  (``LATE_WRITERS``, listed in ``_subtree.py``);
* ``F.rrelu(training=True)`` anywhere else: a verified first forward sees it
  save its noise (``_verify.py``), turns early stop off for that region (torch's
  checkpoint frame, ``_torch_private.recompute_whole``) and remembers the region's
  site (:func:`late_write_found`; sites as in NOTE [ sampled verification ]), so
  every later call of the site recomputes whole. Sampled verification verifies
  each site's first call, so this holds from the first step, unless sampling is
  off (``set_verification_sampling(0)``) or the region's check is ``"none"``:
  then pass ``early_stop=False`` for such regions yourself.
"""

from __future__ import annotations

from torch import nn

from ._sampling import known_site, site
from ._subtree import Listing

__all__ = ["full_recompute", "late_write_found"]


def full_recompute(listing: Listing | None, module: nn.Module | None, fn: object) -> bool:
    """Whether a region running ``module`` (whose subtree ``listing`` is) or ``fn`` must
    recompute whole (NOTE [ late writes ])."""
    if listing is not None:
        late = listing.late
        if late and any((layer := ref()) is not None and layer.training for ref in late):
            return True
    found = known_site(module, fn)
    return found is not None and found.late


def late_write_found(module: nn.Module | None, fn: object) -> None:
    """A region of this site saved a tensor before writing it: recompute its site whole."""
    site(module, fn, count=False).late = True
