"""The region mechanisms: each module owns one thing a region keeps right (its world,
random streams, buffers, hooks, saved ops, verification, its memory report row),
registered here, in order, with the core (NOTE [ region mechanisms ] in
``core/_mechanisms.py``), which imports none of them.

Nothing here is public API: ``scopedckpt`` exports what users call.
"""

from ..core._mechanisms import Mechanism, register_mechanism
from . import (
    _generators,
    _guard,
    _hooks,
    _inputs,
    _report,
    _rng,
    _selective,
    _strict,
    _verify,
    _world,
    _written,
)

# Started and entered in this order, undone in reverse. The report starts last: a
# mechanism refusing the region at its start (a save= policy that cannot apply) leaves
# no row. A new mechanism: a module and a name here (or, for an integration, a
# register_mechanism call in its package).
_ORDER: tuple[Mechanism, ...] = (  # mypy checks each module against the protocol
    _strict,
    _inputs,
    _world,
    _rng,
    _generators,
    _written,
    _hooks,
    _guard,
    _selective,
    _report,
    _verify,
)
for _mechanism in _ORDER:
    register_mechanism(_mechanism)
