"""The README: its two set-up commands (the test one is what CI runs) and the demo's output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scopedckpt import _demo

ROOT = Path(__file__).resolve().parent.parent


def _setup_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]


def _setup_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", _setup_section(), flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("python -m scopedckpt")
    assert commands[1].endswith("python -m pytest")


def test_ci_runs_both_readme_commands_verbatim_in_a_fresh_virtualenv() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    demo, tests = _setup_commands()
    assert demo in ci and tests in ci
    venv = ci.index('python -m venv "$work/venv"')
    assert venv < ci.index(demo) < ci.index(tests)
    # Nothing is installed into the fresh virtualenv before the README's own commands.
    assert not [line for line in ci[venv : ci.index(demo)] if "pip install" in line]


@pytest.fixture(scope="module")
def demo_output() -> str:
    """What ``python -m scopedckpt`` prints (one step six ways: about a second)."""
    return _demo.table()


def test_readme_shows_the_demo_output_verbatim(demo_output: str) -> None:
    """The set-up's text block is what ``python -m scopedckpt`` prints, footer included.

    The output has no timings: on a given torch it is the same on every run and machine.
    """
    shown = re.findall(r"```text\n(.+?)\n```", _setup_section(), flags=re.S)
    assert shown, "README.md: no ```text block with the demo's output under '## Set-up'"
    assert shown[0] == demo_output, (
        "README.md's copy of the demo output is stale; paste `python -m scopedckpt`'s output"
    )


def test_the_demo_footer_divides_by_plain_nn(demo_output: str) -> None:
    """The footer's percentage is the converted run's bytes kept over plain nn's."""
    rows = {
        line[:38].strip(): float(line.split()[-2])
        for line in demo_output.splitlines()
        if line.endswith(" MiB") and not line.startswith("scopedckpt keeps")
    }
    share = rows["scopedckpt, converted layers"] / rows["plain nn, no checkpointing"]
    assert (
        f"scopedckpt keeps {share:.0%} of what plain nn without checkpointing keeps" in demo_output
    )


def test_the_extending_example_runs_as_written() -> None:
    docs = ROOT / "docs" / "extending.md"
    code = re.search(r"```python\n(.+?)```", docs.read_text(), flags=re.S)
    assert code is not None
    namespace: dict[str, object] = {"__name__": "extending_example"}
    exec(compile(code.group(1), str(docs), "exec"), namespace)
    namespace["test_custom_layers_train_exactly"]()  # type: ignore[operator]
