"""Scoped layers: dropout and batch norm that replay their first forward in recomputes,
their masks, and ``convert``.

Nothing here is public API: ``scopedckpt`` exports the layers.
"""
