"""Domain errors of the cache stack.

Invariant violations are ``AssertionError`` (with context); caller misuse is ``ValueError``
listing the valid choices; everything a user or operator can cause at run time is a
``HiCacheError`` subclass, which the CLI maps to a one-line message and an exit code.
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every domain failure."""


class InputError(HiCacheError):
    """Unreadable or malformed user input (trace, log, snapshot, request)."""


class OutOfCapacity(HiCacheError):
    """A tier cannot hold what was asked even after evicting everything evictable."""


class StorageError(HiCacheError):
    """An L3 backend failed (unreachable, I/O error)."""


class CheckFailed(HiCacheError):
    """A checker found a problem (exit code 3 in the CLI)."""


class UsageError(HiCacheError, ValueError):
    """The caller asked for something that cannot be done as asked: a bad option value or a
    combination of options (exit code 2 in the CLI). Library code raises it only where its
    arguments come straight from a user (a configuration checked against this machine, say);
    misuse by code stays a plain ``ValueError``, which the CLI reports as an internal error.
    It is a ``ValueError`` too, so callers that catch bad arguments that way still do."""
