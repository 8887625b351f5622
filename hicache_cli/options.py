"""What every command's options share: how flags read in ``--help``.

Typer's rich help prints a value type beside every option, so an on/off flag reads
``--sweep <bool>`` as if it took a value. A flag takes none: its type column stays empty.
"""

from __future__ import annotations

import typer.core

_display_type_rich = typer.core.TyperOption.display_type_rich


def _flag_shows_no_type(self, ctx):  # type: ignore[no-untyped-def]
    if getattr(self, "is_flag", False) and not getattr(self, "count", False):
        return None
    return _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _flag_shows_no_type  # type: ignore[method-assign]
