"""Rewrite the generated tables of docs/benchmarks.md and docs/memory.md from
``benchmarks/results/*.json``.

Run from the repository root::

    python -m benchmarks.docs            # rewrite both pages in place
    python -m benchmarks.docs --check    # exit 1 if one is not what the results give

A generated region is everything between a ``<!-- generated: NAME -->`` line and the
next ``<!-- end generated -->`` line; NAME is a key of ``tables.TABLES``,
``plan_tables.TABLES`` or ``peak.TABLES`` (docs/memory.md's), or ``targets``. Everything
outside the regions is left as written. Rendering reads the results files only: it runs
no benchmark.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from . import RESULTS, ROOT, peak, plan_tables, targets
from .tables import TABLES, Results

DOC = ROOT / "docs" / "benchmarks.md"
PAGES = (DOC, ROOT / "docs" / "memory.md")  # every page with generated regions
REGION = re.compile(
    r"^(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)^(<!-- end generated -->)$",
    re.MULTILINE | re.DOTALL,
)
OPENING = re.compile(r"^<!-- generated:", re.MULTILINE)
RENDERERS: dict[str, Callable[[Results], list[str]]] = {
    **TABLES,
    **plan_tables.TABLES,
    **peak.TABLES,
    "targets": targets.render,
}


def render(text: str, results: Results) -> str:
    """``text`` with every generated region rendered anew from ``results``.

    Raises
    ------
    KeyError
        A region names no renderer.
    ValueError
        The text has an opening marker without its end, or none at all.
    """

    def region(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"docs: no table named {name!r}; known: {', '.join(RENDERERS)}")
        # Blank lines around the body: a table right after an HTML comment line may not
        # render as one.
        return match[1] + "\n" + "\n".join(RENDERERS[name](results)) + "\n\n" + match[4]

    rendered, count = REGION.subn(region, text)
    if count != len(OPENING.findall(text)):
        raise ValueError("docs: a '<!-- generated: NAME -->' line has no '<!-- end generated -->'")
    if count == 0:
        raise ValueError("docs: no generated region")
    return rendered


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or ``--check``) each document named, every page of ``PAGES`` by default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=list(PAGES))
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    results = Results(RESULTS)
    stale = []
    for path in args.paths:
        text = path.read_text()
        rendered = render(text, results)
        if rendered != text:
            stale.append(path)
            if not args.check:
                path.write_text(rendered)
    for path in stale:
        verb = "is stale" if args.check else "rewritten"
        print(f"{path}: {verb}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
