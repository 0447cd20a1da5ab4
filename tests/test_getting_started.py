"""docs/getting-started.md runs as written: its ``python`` blocks, in order, are one script.

The script builds a tiny Hugging Face GPT-2 from a config (nothing is downloaded), checks
it with ``assert_checkpoint_equivalent``, plans a budget with ``scopedckpt.plan``, trains a
few steps under ``checkpointing(plan)`` and asserts that the loss is finite and falls and
that the plan prints. Slow (it imports transformers): ``python -m pytest -m slow``; CI's
real-model stage runs it. Skipped, with the reason, where transformers is not installed
(``pip install -e '.[real]'``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_the_getting_started_page_runs_as_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    pytest.importorskip(
        "transformers", reason="the page's example needs transformers (pip install -e '.[real]')"
    )
    blocks = _python_blocks()
    assert len(blocks) >= 4, f"{PAGE.name}: expected its python blocks, found {len(blocks)}"
    namespace: dict[str, object] = {"__name__": "getting_started"}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), namespace)

    printed = capsys.readouterr().out
    assert "predicted peak" in printed, "the page's print(plan) printed no plan table"
    losses = namespace["losses"]
    assert isinstance(losses, list) and losses and all(map(math.isfinite, losses))
