"""A serving process moves what it built at start-up out of the garbage collector's passes
(engine/core/heap.py): a full pass then walks only what was made since, not the model, the
cache and the imports (80-100 ms a pass with smollm2-135m loaded)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

from engine.runtime.config import ServerConfig
from engine.runtime.launch import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_freeze_takes_the_objects_alive_out_of_the_passes():
    code = """
import gc
from engine.core.heap import freeze_startup_objects
kept = [[i] for i in range(200_000)]          # long-lived, tracked by the collector
gc.collect()
tracked = len(gc.get_objects())
assert tracked > 200_000, tracked
frozen = freeze_startup_objects()
assert frozen >= 200_000, frozen
assert len(gc.get_objects()) < tracked - 200_000, len(gc.get_objects())
new = [[i] for i in range(1000)]                # made after: the passes still see them
assert any(o is new[0] for o in gc.get_objects())
assert kept[-1] == [199_999]                    # frozen objects are untouched
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_serve_freezes_its_startup_objects_before_it_serves():
    seen: dict = {}

    def ready(url: str, engine) -> None:
        seen["frozen"] = gc.get_freeze_count()
        seen["url"] = url
        os.kill(os.getpid(), signal.SIGINT)        # serve's own handler stops it

    gc.unfreeze()
    try:
        serve(ServerConfig(model="tiny", port=0, l1_tokens=512), on_ready=ready)
    finally:
        gc.unfreeze()                            # this test process: collected as before
    assert seen["url"].startswith("http://127.0.0.1:")
    assert seen["frozen"] > 10_000, seen
