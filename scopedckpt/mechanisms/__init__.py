"""The region mechanisms: each module owns one thing a region keeps right (its world,
random streams, buffers, hooks, saved ops, verification, its memory report row), listed
once in ``core/_mechanisms.py`` (NOTE [ region mechanisms ]).

Nothing here is public API: ``scopedckpt`` exports what users call.
"""
