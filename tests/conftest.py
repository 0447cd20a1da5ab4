"""Hypothesis profiles: ``ci`` (default, quick) and ``thorough`` (by hand).

Select with ``HYPOTHESIS_PROFILE=thorough python -m pytest``.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,  # derandomized: the same examples every run; CI runs suites side by side
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Small tensors: threads only add scheduling noise, never speed, here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_scope_leaks():
    """Every test must leave no scope, frame, patch or global hook behind."""
    import torch.utils.checkpoint as torch_checkpoint

    from scopedckpt.core import _patch, _sampling, _targets
    from scopedckpt.core._state import FRAME, SCOPE
    from scopedckpt.mechanisms import _guard, _report

    # What scopedckpt remembers per site (_sampling.Site: sampled verification's counts,
    # late writes, the light check's tail, the world, the watch's generators), some sites
    # (module-level functions) shared by tests: each test starts afresh.
    _sampling._Sampling.sites.clear()
    yield
    gc.collect()  # regions hold target patches until torch frees them
    assert SCOPE.get() is None, "a checkpointing scope leaked out of the test"
    assert FRAME.get() is None, "a region frame leaked out of the test"
    assert not _targets._PATCHES, "a module forward patch leaked out of the test"
    assert not _guard.installed(), "the buffer guard's global module hooks leaked out of the test"
    assert not _patch._ORIGINALS, "patch_torch_checkpoint left torch.utils.checkpoint patched"
    assert torch_checkpoint.checkpoint.__module__ == "torch.utils.checkpoint"
    assert not _report._ACTIVE, "a memory_report block leaked out of the test"


def pytest_collection_modifyitems(config, items):
    """Shuffle the tests when ``SCOPEDCKPT_SHUFFLE=<seed>`` is set (hunting order dependence)."""
    seed = os.environ.get("SCOPEDCKPT_SHUFFLE")
    if seed:
        import random

        random.Random(int(seed)).shuffle(items)


@pytest.fixture
def no_sampling():
    """No sampled verification (NOTE [ sampled verification ]): for tests of what torch's
    own check or scopedckpt's counters do without it."""
    import scopedckpt

    previous = scopedckpt.set_verification_sampling(0)
    yield
    scopedckpt.set_verification_sampling(previous)
