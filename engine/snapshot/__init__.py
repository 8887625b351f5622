"""Radix-tree snapshots: ``take`` turns a live :class:`HiCache` into the snapshot format
(formats/snapshot.py) and back into a read-only view tree; ``views`` holds the queries
``hicache inspect`` renders (summary, hot prefixes, owners, diff).
"""
