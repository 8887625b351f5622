"""One-line errors for the benchmark scripts that read a user's file (a trace): a missing,
unreadable or malformed input ends the script with one line and exit status 1, not a traceback
(the same rule as the ``hicache`` commands)."""

from __future__ import annotations

import subprocess
import sys


def run(name: str, main):
    """Call ``main()`` and return its result; user-caused failures exit with one line."""
    try:
        return main()
    except subprocess.CalledProcessError as e:   # the command printed its own one-line error
        sys.exit(f"{name}: {e.cmd[0]} {' '.join(map(str, e.cmd[1:5]))} … exited with "
                 f"{e.returncode}")
    except OSError as e:
        sys.exit(f"{name}: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
    except Exception as e:
        try:
            from engine.core.errors import HiCacheError
        except ImportError:
            raise e from None
        if isinstance(e, HiCacheError):
            sys.exit(f"{name}: {e}")
        raise
