"""String enums for policies, layouts and backends: one parser with one error message."""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound="Choice")


class Choice(str, enum.Enum):
    """A ``str`` enum whose :meth:`parse` raises ``ValueError`` listing the valid choices."""

    @classmethod
    def parse(cls: type[E], value: "str | E") -> E:
        try:
            return cls(value)
        except ValueError:
            what = getattr(cls, "__what__", cls.__name__)
            raise ValueError(f"unknown {what} {value!r}; choose one of "
                             f"{[m.value for m in cls]}") from None
