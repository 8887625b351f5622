"""Mooncake faults against a real mooncake_master: unreachable at start, killed mid-run and
restarted (misses and failed puts while it is down, counted; reconnection after)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from engine.core.errors import StorageError
from engine.storage import L3Store, StorageConfig, make_backend
from engine.storage.backends.mooncake import MooncakeBackend
from engine.storage.config import MooncakeStoreConfig
from engine.storage.placement import Placement
from tests.factories import STORE_LAYOUT as LAYOUT
from tests.factories import page_chain as chain
from tests.factories import store_pool as pool
from tests.mooncake_master import MooncakeMaster, free_port

ONE_OBJECT = Placement(grid="layers=2,heads=2")   # a page is one object (a 1×1 grid)




def test_unreachable_master_fails_fast_with_a_clear_error():
    port = free_port()
    cfg = StorageConfig("mooncake", mooncake=MooncakeStoreConfig(
        master_server_address=f"127.0.0.1:{port}",
        metadata_server=f"http://127.0.0.1:{port}/metadata", connect_timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=rf"master 127.0.0.1:{port} is unreachable.*L3 "
                                           r"storage is off"):
        make_backend(cfg)
    assert time.monotonic() - t0 < 3


def test_unreachable_metadata_server_fails_fast(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    try:
        port = free_port()
        with pytest.raises(StorageError, match="metadata server"):
            MooncakeBackend(m.config(metadata_server=f"http://127.0.0.1:{port}/metadata"))
    finally:
        m.stop()


def wait_for(pred, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return False


def test_master_killed_mid_run_then_back(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    cfg_file = tmp_path / "mooncake.json"
    cfg_file.write_text(json.dumps(m.config_dict()))          # Mooncake's own format
    cfg = StorageConfig.from_json_file(cfg_file)
    b = make_backend(StorageConfig("mooncake", mooncake=m.config(backoff_max_s=0.4)))
    assert cfg.mooncake.master_server_address == b.config.master_server_address
    st = L3Store(b, LAYOUT, placement=ONE_OBJECT)
    src, dst = pool(), pool(fill=False)
    hs = chain(4)
    try:
        assert st.put_pages(hs, src, [0, 1, 2, 3]) == 4
        assert st.get_pages(hs, dst, [4, 5, 6, 7]) == 4

        m.stop()
        assert wait_for(lambda: b.health()["health_check"] != 0, 10)
        t0 = time.monotonic()
        assert st.exists_prefix(hs) == 0                      # misses, not exceptions
        assert st.get_pages(hs, dst, [4, 5, 6, 7]) == 0
        assert st.put_pages(chain(2), src, [0, 1]) == 0       # failed puts
        assert time.monotonic() - t0 < 1.0                    # no RPC timeouts while down
        h = b.health()
        assert h["healthy"] is False and h["errors"] >= 1
        assert st.counters["errors"] >= 1 and st.counters["put_failed"] == 2

        m.start()                                             # same ports
        fresh = chain(3)
        assert wait_for(lambda: st.put_pages(fresh, src, [0, 1, 2]) == 3, 20, 0.2)
        assert st.get_pages(fresh, dst, [5, 6, 7]) == 3
        assert all(torch.equal(src.get_page(i), dst.get_page(5 + i)) for i in range(3))
        h = b.health()
        assert h["healthy"] is True and h["reconnects"] >= 1
    finally:
        if m.proc is None:
            m.start()                                         # never close against a dead master
        st.close()
        m.stop()
