"""The region engine and the scope: how a call becomes a checkpoint region, the context
state its frames run in, the sites it remembers, and the one list of region mechanisms.

Nothing here is public API: ``scopedckpt`` exports what users call.
"""
