"""The scoped dropout implementation: one seed per call, recorded and replayed.

Each call in training mode draws one seed, from ``generator`` when given or
else from torch's default CPU generator (so ``torch.manual_seed`` reproduces a
run), and builds its mask from it alone (a private generator seeded with it,
or a hash of it for large CPU masks: NOTE [ hashed bits ] in ``_mask.py``). Inside a
checkpoint region the seed goes on the region's tape and the recompute builds
the identical mask from it; no global RNG state is stashed or restored, and the
global stream advances exactly as much as in a run without checkpointing.

For backward the mask is kept as one byte per element (``save_mask=True``,
the default; channel-wise dropout keeps its float noise, one value per channel)
or rebuilt from the seed (``save_mask=False``: no memory, one more random pass
in backward). Both give the same bits (NOTE [ two formulations ] in ``_mask.py``).

NOTE [ aligned draws ]
======================
A seed drawn from torch's default generator in the first forward is drawn
again in every recompute of a region that replays the RNG (NOTE [ RNG replay ]
in ``_rng.py``), and checked against the recorded seed, which is the one used.
Without that draw, every unscoped random op after a scoped dropout in the same
region (timm's ``proj_drop`` then ``drop_path``) would see a stream shifted by
one draw in the recompute. A seed from a user's ``generator=`` is drawn again
only in a recompute that replays that generator (NOTE [ explicit generators ]
in ``_generators.py``: an unscoped op in the region draws from it too, or the
region can reach it): the replay rewinds it, and the unscoped draws after the
seed must see it advanced past the seed, as in the first forward.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch
from torch import Tensor

from ..core._errors import ScopedCkptError
from ..core._names import frame_region_name
from ..core._paths import EAGER, GRAPH, where
from ..core._replay import tape_value
from ..core._state import FRAME, RECOMPUTE
from ..core._torch_private import functorch_level
from ..mechanisms import _generators, _rng
from ..mechanisms._strict import scoped_draws
from ._mask import Mask, masked_dropout

__all__ = ["check_p", "scoped_dropout"]

_SEED_HIGH = 2**62


def check_p(p: Any, name: str) -> float:
    """``p`` as a float, if it is a probability; ``name`` (the caller) is for the error."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(
            f"scopedckpt: {name} expected p to be a float probability, got "
            f"{type(p).__name__}. Pass e.g. p=0.1."
        )
    if not 0.0 <= float(p) <= 1.0 or math.isnan(float(p)):
        raise ValueError(
            f"scopedckpt: {name} expected p between 0 and 1 (the probability of "
            f"zeroing an element), got p={p}. Pass e.g. p=0.1."
        )
    return float(p)


def _draw_seed(generator: torch.Generator | None) -> int:
    device = generator.device if generator is not None else torch.device("cpu")
    with scoped_draws():
        return int(torch.randint(0, _SEED_HIGH, (), generator=generator, device=device))


def _redraw(seed: int, owner: object, generator: torch.Generator | None) -> None:
    """Draw the recorded seed again where the recompute replays its generator, to keep
    that stream aligned (NOTE [ aligned draws ])."""
    frame = FRAME.get()
    if frame is None:
        return
    if generator is None:
        replays, source = _rng.replays(frame.tape), "torch's default generator"
    else:
        replays, source = _generators.replays(frame.tape, generator), "its generator"
    if not replays:
        return
    again = _draw_seed(generator)
    if again != seed:
        raise ScopedCkptError(
            f"scopedckpt: the recompute of {frame_region_name(frame)} drew other random "
            "numbers than its first forward: give its scoped layers their own generator=...\n"
            f"It drew seed {again} for {frame.name(owner)} from {source}, but its first "
            f"forward drew {seed} at the same point: data-dependent random draws, or another "
            "thread drawing from that generator while the region ran. Or keep such draws "
            "outside checkpoint regions."
        )


# torch's own dropout ops by (feature, alpha): (out of place, in place).
_TORCH_OPS = {
    (False, False): (torch.dropout, torch.dropout_),
    (True, False): (torch.feature_dropout, torch.feature_dropout_),
    (False, True): (torch.alpha_dropout, torch.alpha_dropout_),
    (True, True): (torch.feature_alpha_dropout, torch.feature_alpha_dropout_),
}


def scoped_dropout(
    function: str,
    input: Tensor,
    p: float,
    training: bool,
    inplace: bool,
    generator: torch.Generator | None,
    save_mask: bool,
    owner: object,
) -> Tensor:
    """The one dropout implementation behind every scoped function and layer.

    ``function`` is the name of torch's functional counterpart (``"dropout2d"``): it
    says what is zeroed and how the input's rank is checked. ``p`` is already checked
    (:func:`check_p`); ``owner``, the layer or the public function, keys the tape.
    """
    alpha = "alpha" in function
    feature = function not in ("dropout", "alpha_dropout")
    batched = _batched(function, input)
    if not batched:
        input = input.unsqueeze_(0) if inplace else input.unsqueeze(0)
    if feature and input.dim() < 2:
        raise RuntimeError(
            f"scopedckpt: channel-wise dropout needs input with at least 2 dimensions "
            f"(N, C, ...), but got shape {tuple(input.shape)}. Use dropout or alpha_dropout "
            "for element-wise dropout."
        )
    here = where()
    if generator is None and (here is GRAPH or (here is EAGER and functorch_level() is not None)):
        # Compiled: Inductor's generator, replayed by torch's checkpoint operator (NOTE
        # [ torch.compile ] in _compiled.py). Under vmap or grad a seed cannot be read out
        # of a batched draw, and regions run plainly there (NOTE [ torch.func transforms ]).
        # Either way torch's own op, as torch's layer.
        out_of_place, in_place = _TORCH_OPS[feature, alpha]
        out = (in_place if inplace else out_of_place)(input, p, training)
    else:
        seeded = _seeded_dropout if here is EAGER else _seeded_dropout_outside_dynamo
        out = seeded(input, p, training, inplace, generator, save_mask, feature, alpha, owner)
    if not batched:
        out = out.squeeze_(0) if inplace else out.squeeze(0)
    return out


def _batched(function: str, input: Tensor) -> bool:
    """Whether ``input`` has its batch dimension, its rank checked as torch's ``function``
    checks it, with torch's error and warnings (only dropout1d/2d/3d may lack it)."""
    if function not in ("dropout1d", "dropout2d", "dropout3d"):
        return True
    spatial = int(function[-2])
    if input.dim() not in (spatial + 1, spatial + 2):
        if spatial == 1:
            raise RuntimeError(
                f"scopedckpt: dropout1d expected 2D (C, L) or 3D (N, C, L) input, but got a "
                f"{input.dim()}D input. Use dropout for element-wise dropout."
            )
        warnings.warn(
            f"{function}: Received a {input.dim()}-D input to {function}, which is deprecated "
            f"and will result in an error in a future release. To retain the behavior "
            f"and silence this warning, please use dropout instead. Note that {function} "
            f"exists to provide channel-wise dropout on inputs with {spatial} spatial "
            f"dimensions, a channel dimension, and an optional batch dimension "
            f"(i.e. {spatial + 1}D or {spatial + 2}D inputs).",
            stacklevel=3,  # the public function or the layer's forward
        )
    if spatial != 2:
        return input.dim() == spatial + 2
    if input.dim() == 3:  # taken as batched (N, C, L), as torch does
        warnings.warn(
            "dropout2d: Received a 3D input to dropout2d and assuming that channel-wise "
            "1D dropout behavior is desired - input is interpreted as shape (N, C, L), where C "
            "is the channel dim. This behavior will change in a future release to interpret the "
            "input as one without a batch dimension, i.e. shape (C, H, W). To maintain the 1D "
            "channel-wise dropout behavior, please switch to using dropout1d instead.",
            stacklevel=4,  # the public function's caller, or torch's Module._call_impl
        )
    return True


def _seeded_dropout(
    input: Tensor,
    p: float,
    training: bool,
    inplace: bool,
    generator: torch.Generator | None,
    save_mask: bool,
    feature: bool,
    alpha: bool,
    owner: object,
) -> Tensor:
    """Dropout from a per-call seed, recorded and replayed in regions (eager code)."""

    def decide() -> tuple[bool, int | None, bool]:
        if not (training and 0.0 < p < 1.0 and input.numel() > 0):
            return training, None, False
        return True, _draw_seed(generator), generator is None

    (was_training, seed, from_default), phase = tape_value("dropout", owner, decide)
    if seed is not None and phase is RECOMPUTE:
        _redraw(seed, owner, None if from_default else generator)
    if not was_training or p == 0.0 or input.numel() == 0:
        return input
    if seed is None:  # p == 1: everything dropped, nothing random
        zero = torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input * zero
    shape = tuple(input.shape[:2]) + (1,) * (input.dim() - 2) if feature else tuple(input.shape)
    mask = Mask(seed, p, shape, input.device, alpha, save_mask)
    return masked_dropout(input, mask, inplace, recompute=phase is RECOMPUTE)


# It reads the region's tape: compiled code calls it behind a graph break.
_seeded_dropout_outside_dynamo = torch.compiler.disable(_seeded_dropout)
