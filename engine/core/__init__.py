"""Core values every other subsystem uses: errors, enum choices, device probing, page hashing and
the frozen KV layout value.

Nothing here imports another ``engine`` subpackage. A new value type that several subsystems share
(and that knows nothing about trees, pools or ranks) goes here.
"""
