"""A step's memory timeline as one self-contained HTML page: live bytes against op index in
inline SVG, each phase and region's stretch shaded, the peak marked, the report's table below.

The page has no script, style sheet, font or image from elsewhere: it opens offline, and
its size is bounded (at most two points per horizontal pixel, each the most live in its
range of ops, so the peak is never lost to the thinning).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from ._budget import format_bytes

__all__ = ["page", "svg"]

_WIDTH, _HEIGHT, _LEFT, _RIGHT, _TOP, _BOTTOM = 960, 320, 72, 16, 24, 40
_SHADES = {  # phase -> fills; regions of one phase alternate between them
    "forward": ("#dbe9f6", "#c6dbef"),
    "recompute": ("#d5efd5", "#b8e2b8"),
    "backward": ("#fde3c8", "#fde3c8"),
    "optimizer step": ("#e6e0f0", "#e6e0f0"),
}


def page(
    timeline: Sequence[int],
    phases: Sequence[tuple[int, str, str | None]],
    peak_index: int,
    table: str,
) -> str:
    """The HTML page: :func:`svg`'s picture and the report's table under it.

    Example
    -------
    >>> html = page([0, 4, 8, 2], [(0, "forward", None), (2, "backward", None)], 2, "t")
    >>> html.count("<svg"), "peak 8 B" in html
    (1, True)
    """
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>scopedckpt peak report'
        f"</title></head><body>\n{svg(timeline, phases, peak_index)}\n"
        f"<pre>{escape(table)}</pre>\n</body></html>\n"
    )


def svg(
    timeline: Sequence[int], phases: Sequence[tuple[int, str, str | None]], peak_index: int
) -> str:
    """The picture, an inline ``<svg>`` element: ``timeline`` (live bytes after each op),
    ``phases`` ((first op, phase, region) of each stretch) shaded, the peak's op marked."""
    width, height = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    n, top = len(timeline), max(max(timeline, default=0), 1)

    def x(op: float) -> float:
        return _LEFT + width * op / max(n - 1, 1)

    def y(nbytes: float) -> float:
        return _TOP + height * (1 - nbytes / top)

    parts = []
    regions: dict[str | None, int] = {}
    for i, (first, phase, region) in enumerate(phases):
        last = phases[i + 1][0] if i + 1 < len(phases) else n - 1
        fill = _SHADES.get(phase, ("#eeeeee",))[regions.setdefault(region, len(regions)) % 2]
        name = escape(phase if region is None else f"{phase} of {region}")
        parts.append(
            f'<rect x="{x(first):.1f}" y="{_TOP}" width="{max(x(last) - x(first), 0.5):.1f}" '
            f'height="{height}" fill="{fill}"><title>{name}: ops {first}-{last}</title></rect>'
        )
    step = max(1, n // (2 * width))  # ops per point; each point the most live in its ops
    points = [(i, max(timeline[i : i + step])) for i in range(0, n, step)]
    line = " ".join(f"{x(i):.1f},{y(b):.1f}" for i, b in points)
    parts.append(
        f'<polygon points="{x(0):.1f},{y(0):.1f} {line} {x(n - 1):.1f},{y(0):.1f}" '
        'fill="#4a7ebb" fill-opacity="0.35" stroke="#1f4e8c" stroke-width="1"/>'
    )
    for fraction in (0, 0.5, 1):
        parts.append(
            f'<text x="{_LEFT - 6}" y="{y(top * fraction) + 4:.1f}" text-anchor="end">'
            f"{format_bytes(top * fraction)}</text>"
        )
    peak = timeline[peak_index] if 0 <= peak_index < n else 0
    px, anchor = x(peak_index), "end" if peak_index > n / 2 else "start"
    parts += [
        f'<line x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{_TOP + height}" stroke="#c00"/>',
        f'<circle cx="{px:.1f}" cy="{y(peak):.1f}" r="4" fill="#c00"/>',
        f'<text x="{px + (-6 if anchor == "end" else 6):.1f}" y="{_TOP + 14}" '
        f'text-anchor="{anchor}" fill="#c00">peak {format_bytes(peak)} (op {peak_index})</text>',
        f'<text x="{_LEFT}" y="{_HEIGHT - 8}">op index, 0 to {max(n - 1, 0)}</text>',
    ]
    for i, (phase, fills) in enumerate(_SHADES.items()):  # the legend
        left = _LEFT + 200 + 150 * i
        parts.append(
            f'<rect x="{left}" y="{_HEIGHT - 19}" width="12" height="12" fill="{fills[0]}"/>'
            f'<text x="{left + 16}" y="{_HEIGHT - 8}">{phase}</text>'
        )
    return (
        f'<svg width="{_WIDTH}" height="{_HEIGHT}" '
        f'font-family="sans-serif" font-size="12">{"".join(parts)}</svg>'
    )
