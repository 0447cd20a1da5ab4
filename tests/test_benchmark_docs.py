"""docs/benchmarks.md is what benchmarks/results/*.json give, and benchmarks/ stays a package.

Rendering reads the results files only: no benchmark runs here. When a results file
changes, ``python -m benchmarks.docs`` rewrites the page.
"""

from __future__ import annotations

import ast
import doctest
import json
import re
from pathlib import Path

import pytest
import torch

from benchmarks import RESULTS, docs, internals, tables, timing

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "benchmarks"
ENTRY_POINTS = {"run", "docs"}  # no other module imports these


@pytest.mark.parametrize("page", docs.PAGES, ids=lambda path: path.name)
def test_each_page_is_generated_from_the_results_files(page: Path) -> None:
    text = page.read_text()
    rendered = docs.render(text, tables.Results(RESULTS))
    assert rendered == text, f"docs/{page.name} is stale: run `python -m benchmarks.docs`"


def test_every_results_file_is_on_the_page_with_the_command_that_writes_it() -> None:
    names = tables.Results(RESULTS).names()
    assert set(names) == set(tables.WRITTEN_BY)
    text = docs.DOC.read_text()
    for name in names:
        assert f"`results/{name}.json`" in text


def test_every_marker_names_a_table_and_every_table_is_used() -> None:
    text = "".join(page.read_text() for page in docs.PAGES)
    used = re.findall(r"^<!-- generated: ([\w-]+) -->$", text, re.MULTILINE)
    assert sorted(used) == sorted(docs.RENDERERS)


def test_render_refuses_an_unknown_table_and_an_unclosed_region() -> None:
    results = tables.Results(RESULTS)
    with pytest.raises(KeyError, match="no table named 'nope'"):
        docs.render("<!-- generated: nope -->\n<!-- end generated -->\n", results)
    with pytest.raises(ValueError, match="has no '<!-- end generated -->'"):
        docs.render("<!-- generated: files -->\n", results)


def test_a_missing_results_file_names_the_command_to_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"small_models\.json is missing"):
        tables.small_models(tables.Results(tmp_path))


@pytest.mark.parametrize("quick", [False, True])
def test_quick_results_are_marked_above_their_table(tmp_path: Path, quick: bool) -> None:
    data = json.loads((RESULTS / "small_models.json").read_text())
    (tmp_path / "small_models.json").write_text(json.dumps({**data, "quick": quick}))
    lines = tables.small_models(tables.Results(tmp_path))
    assert lines[0].startswith("*From a `--quick` run") == quick


def test_commands_on_the_page_name_benchmark_modules_that_exist() -> None:
    text = docs.DOC.read_text()
    modules = set(re.findall(r"python -m benchmarks\.(\w+)", text))
    assert modules >= {"run", "compiled", "selective", "small_models", "threads", "docs"}
    assert all((PACKAGE / f"{module}.py").exists() for module in modules)
    assert "python benchmarks/" not in text


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved inside benchmarks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("benchmarks." + (node.module or "")).rstrip(".") if node.level else node.module
            found.append(base or "")
            if node.level and not node.module:  # from . import models
                found += [f"benchmarks.{alias.name}" for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_modules_import_no_tests_no_pytest_no_entry_point(path: Path) -> None:
    source = path.read_text()
    assert "sys.path" not in source
    imported = _imports(path)
    assert not [m for m in imported if m.split(".")[0] in {"tests", "pytest"}]
    siblings = {p.stem for p in PACKAGE.glob("*.py")}
    assert not [m for m in imported if m in siblings], "import siblings as benchmarks.<name>"
    assert not [m for m in imported if m.removeprefix("benchmarks.") in ENTRY_POINTS]
    if path.name != "internals.py":
        private = [m for m in imported if m.startswith("scopedckpt.") and "._" in f".{m}"]
        assert not private, "use internals.py"
        assert "from scopedckpt import _" not in source, "use internals.py"


def test_the_private_names_benchmarks_reach_still_exist() -> None:
    missing = [f"{m.__name__}.{name}" for m, name in internals.REACHED if not hasattr(m, name)]
    assert not missing, f"move benchmarks/internals.py to scopedckpt's new names: {missing}"
    for owner, attribute in internals.PIECES.values():
        assert callable(getattr(owner, attribute))


def test_the_region_pieces_machinery_times_still_take_their_arguments() -> None:
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    pieces = internals.RegionPieces(block, torch.randn(2, 4, requires_grad=True))
    pieces.set_up()
    pieces.enter_and_exit()
    with pieces.in_frame():
        pieces.hook(block[0])()


def test_benchmark_modules_import_each_other_without_a_cycle() -> None:
    siblings = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph = {
        name: {m.removeprefix("benchmarks.") for m in _imports(PACKAGE / f"{name}.py")} & siblings
        for name in siblings
    }
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for imported in graph[name]:
                visit(imported, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())


@pytest.mark.parametrize("module", [tables, timing], ids=lambda m: m.__name__)
def test_benchmark_docstring_examples_run(module: object) -> None:
    failed, attempted = doctest.testmod(module)  # type: ignore[arg-type]
    assert attempted and not failed
