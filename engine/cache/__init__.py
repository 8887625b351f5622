"""The single-rank cache stack, bottom to top: allocator (free slots) -> pool (bytes of one tier)
-> transfer (moving pages between tiers) -> radix_tree (prefix index) + policy (eviction order)
-> facade (:class:`HiCache`, the one object callers use), with its event log and L3 steps.

It is rank-agnostic: it never imports ``parallel``, ``runtime`` or ``sim``; the distributed layers
wrap it. A new tier, pool layout or eviction policy goes here; anything that knows about ranks
does not.
"""
