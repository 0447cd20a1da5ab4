"""The README's two set-up commands: the test one is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


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


def test_the_extending_example_runs_as_written() -> None:
    docs = ROOT / "docs" / "extending.md"
    code = re.search(r"```python\n(.+?)```", docs.read_text(), flags=re.S)
    assert code is not None
    namespace: dict[str, object] = {"__name__": "extending_example"}
    exec(compile(code.group(1), str(docs), "exec"), namespace)
    namespace["test_custom_layers_train_exactly"]()  # type: ignore[operator]
