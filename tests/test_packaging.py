"""The built wheel: what it contains, and that it runs the demo when installed for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what the wheel is made of: setuptools builds in the source
    # tree's build/, which two suites run side by side (.ci/run) would share.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "scopedckpt", source / "scopedckpt", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)],
        check=True,
    )
    (built,) = out.glob("scopedckpt-*.whl")
    return built


def test_wheel_ships_the_typed_marker_and_the_license(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "scopedckpt/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: MIT" in text
    assert not [n for n in names if n.startswith("tests/")]


def test_installed_wheel_runs_the_demo_without_warnings(wheel: Path, tmp_path: Path) -> None:
    """A non-editable install into a fresh virtualenv; torch comes from this environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # No PYTHONPATH: pip would find a scopedckpt there and skip the install.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
        env=env,
    )
    # Reuse this environment's torch (a second 750 MB install would only cost time): a
    # path entry, not a site dir, so the editable scopedckpt of this environment stays out.
    torch_site = Path(torch.__file__).resolve().parent.parent
    (site / "torch_from_parent.pth").write_text(f"{torch_site}\n")
    where = subprocess.run(
        [str(python), "-c", "import scopedckpt; print(scopedckpt.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.strip()
    assert Path(where).is_relative_to(site), where
    demo = subprocess.run(
        [str(python), "-W", "error", "-m", "scopedckpt"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert "scopedckpt" in demo.stdout and "bitwise" in demo.stdout
    assert demo.stderr == ""
    assert sysconfig.get_paths()["purelib"] != str(site)
