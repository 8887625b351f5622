"""Errors of the on-disk formats (this package imports nothing from engine/)."""

from __future__ import annotations


class FormatError(Exception):
    """A file is not in the expected format (message names the file and where)."""
