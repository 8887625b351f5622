"""Offline simulation behind ``hicache bench replay``: trace replay through the cache facade (one
rank or several gloo ranks) and capacity sweeps; and the main job behind ``hicache bench``
(``main_job``: one workload against an embedded server, L1 only and then HiCache).

The top layer of the engine: it may import every other subsystem; nothing imports it.
"""
