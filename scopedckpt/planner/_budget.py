"""Budgets as users write them (bytes, sizes, fractions of the peak) and sizes as plans
print them."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_budget(budget: int | float | str, no_checkpoint_peak: int) -> int:
    """A budget in bytes: an int, a size string (``"512MiB"``, ``"3GB"``) or a float in
    (0, 1], the fraction of the step's peak without checkpointing.

    Example
    -------
    >>> parse_budget("1.5KiB", 0), parse_budget(0.5, 4096), parse_budget(100, 0)
    (1536, 2048, 100)
    """
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget <= 0:
            raise ValueError(f"scopedckpt: plan(budget={budget}) must be positive bytes.")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"scopedckpt: plan(budget={budget}): a float budget is the fraction of the "
                "step's peak without checkpointing, in (0, 1]; pass bytes as an int or a "
                "string such as '512MiB'."
            )
        return max(1, int(budget * no_checkpoint_peak))
    if isinstance(budget, str):
        match = _BUDGET.match(budget)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"scopedckpt: plan(budget={budget!r}) is not a size; write a number and a "
                "unit: '512MiB', '3GB', '1.5GiB' (KiB/MiB/GiB are powers of 2, KB/MB/GB of "
                "10), or pass bytes as an int."
            )
        size = int(float(match.group(1)) * _UNITS[unit])
        if size <= 0:
            raise ValueError(f"scopedckpt: plan(budget={budget!r}) must be positive bytes.")
        return size
    raise TypeError(
        f"scopedckpt: plan(budget=...) must be an int, a float or a str, got "
        f"{type(budget).__name__}."
    )


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable
