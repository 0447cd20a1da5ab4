"""CHANGELOG.md stays a changelog for users, in Keep a Changelog form.

https://keepachangelog.com: a ``# Changelog`` title, ``## [Unreleased]`` on top, then one
``## [X.Y.Z] - YYYY-MM-DD`` heading per release, each grouped under Added / Changed /
Deprecated / Removed / Fixed / Security. One short line per user-visible change, with no
internal module names or mutation-testing vocabulary: those belong in commit messages.
These tests only read the file (no torch work).
"""

from __future__ import annotations

import re
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"

MAX_LINES = 150
MAX_BULLET_CHARS = 250
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$")
PRIVATE_MODULE = re.compile(r"\b_[a-z]\w*\.py\b")
MUTANT = re.compile(r"mutant", re.IGNORECASE)


def _lines() -> list[str]:
    return CHANGELOG.read_text(encoding="utf-8").splitlines()


def test_changelog_is_keep_a_changelog_form() -> None:
    lines = _lines()
    assert lines and lines[0] == "# Changelog", "CHANGELOG.md must start with '# Changelog'"
    versions = [line for line in lines if line.startswith("## ")]
    assert versions, "no version headings ('## [...]')"
    assert versions[0] == "## [Unreleased]", (
        f"the first version heading must be '## [Unreleased]', got {versions[0]!r}"
    )
    releases = versions[1:]
    bad = [line for line in releases if not RELEASE.match(line)]
    assert not bad, f"release headings must read '## [X.Y.Z] - YYYY-MM-DD': {bad}"
    assert any(line.startswith("## [0.1.0] - ") for line in releases), (
        "no '## [0.1.0] - YYYY-MM-DD' heading after '## [Unreleased]'"
    )


def test_changelog_sections_are_keep_a_changelog_kinds() -> None:
    in_version = False
    for number, line in enumerate(_lines(), start=1):
        if line.startswith("## "):
            in_version = True
        elif in_version and re.match(r"^#{3,} ", line):
            heading = line.lstrip("#").strip()
            assert line.startswith("### ") and heading in SECTIONS, (
                f"CHANGELOG.md:{number}: section {line!r} is not one of "
                f"{', '.join(sorted(SECTIONS))} (as '### Name')"
            )


def test_changelog_is_short_with_one_short_line_per_change() -> None:
    lines = _lines()
    assert len(lines) <= MAX_LINES, (
        f"CHANGELOG.md has {len(lines)} lines, over {MAX_LINES}: one line per user-visible "
        "change; measurements and narratives go in commit messages"
    )
    long = [
        f"CHANGELOG.md:{number}: {len(line)} characters"
        for number, line in enumerate(lines, start=1)
        if line.lstrip().startswith(("- ", "* ")) and len(line) > MAX_BULLET_CHARS
    ]
    assert not long, f"bullets over {MAX_BULLET_CHARS} characters: {long}"


def test_changelog_names_no_internal_modules_or_mutants() -> None:
    leaks = [
        f"CHANGELOG.md:{number}: {line[:80]!r}"
        for number, line in enumerate(_lines(), start=1)
        if PRIVATE_MODULE.search(line) or MUTANT.search(line)
    ]
    assert not leaks, (
        f"internal module names or mutants in the changelog (keep them in commit messages): {leaks}"
    )
