"""The memory-budget planner: ``plan()`` profiles a step, models each block's choices and
solves for the fastest plan within a budget; it depends on the core, never the reverse.

Nothing here is public API: ``scopedckpt`` exports ``plan`` and ``Plan``.
"""
