"""What knows about ranks: process groups, online rank consensus, divergence injection for tests
(and, as they land, TP/CP sharding and PP synchronisation).

It wraps the rank-agnostic cache stack (``engine.cache``) and never the reverse. A new collective
step or rank-topology value goes here.
"""
