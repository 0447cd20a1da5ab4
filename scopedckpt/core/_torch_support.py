"""Which torch releases scopedckpt supports, and what it says when torch lacks a piece.

The floor (:data:`OLDEST_TORCH`) is checked when the package is imported; a
mechanism whose private torch name is gone names the torch version and the
missing piece (:func:`missing_piece`; NOTE [ torch versions ] in
``_torch_private.py``).
"""

from __future__ import annotations

import re

import torch

__all__ = ["OLDEST_TORCH", "check_torch", "missing_piece"]

# The oldest torch tested. torch 2.12 does not throw an exception raised in a
# region's forward into its checkpoint generator, so scopedckpt's contexts would
# stay entered until a garbage collection, and its dynamo replays a forward patch
# removed inside a compiled step as a failing delattr (docs/migration.md).
OLDEST_TORCH = (2, 13)


def check_torch(version: str) -> None:
    """Raise ImportError for a torch older than :data:`OLDEST_TORCH`."""
    release = re.match(r"(\d+)\.(\d+)", version)
    if release is None or (int(release[1]), int(release[2])) < OLDEST_TORCH:
        raise ImportError(
            f"scopedckpt needs torch >= {'.'.join(map(str, OLDEST_TORCH))}, but torch "
            f"{version} is installed: on older torch an exception inside a checkpoint "
            "region would leave scopedckpt's scope active. Upgrade torch "
            "(pip install 'torch>=2.13')."
        )


def missing_piece(piece: str, feature: str) -> str:
    """The message for a torch that lacks what ``feature`` relies on."""
    return (
        f"scopedckpt: {feature} relies on {piece}, which torch {torch.__version__} does not "
        "have or no longer uses, so it would silently run torch's own checkpoint (batch "
        "norm updated twice, randomness not replayed). Install a torch this scopedckpt "
        "release supports (README: 'Tested with'), or upgrade scopedckpt; until then use "
        "scopedckpt.checkpoint or checkpointing(targets) instead."
    )
