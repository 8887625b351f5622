"""Offline simulation behind ``hicache bench replay``: trace replay through the cache facade (one
rank or several gloo ranks) and capacity sweeps.

The top layer of the engine: it may import every other subsystem; nothing imports it.
"""
