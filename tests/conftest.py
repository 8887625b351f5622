"""Shared pytest setup.

* GPU tests (marked ``gpu``) run where a CUDA device exists and are skipped elsewhere.
* Mooncake tests (marked ``mooncake``, or parametrized/named ``mooncake``) need the Debian packages
  the Mooncake wheel links (libibverbs1, libnuma1). ``make test`` installs them when it can
  (scripts/system_deps.sh); where it could not, they are skipped with the command to run.
"""

import ctypes.util
import os

# Before torch loads: spin-waiting OpenMP threads slow to a crawl when the test's server and
# client share the 2 cores of a CI machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every event the engine records is checked against its kind's fields (formats.ranklog_events).
os.environ.setdefault("HICACHE_STRICT_EVENTS", "1")

import pytest  # noqa: E402


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here, or None when they can."""
    libs = {"libibverbs1": "ibverbs", "libnuma1": "numa"}
    missing = [pkg for pkg, lib in libs.items() if ctypes.util.find_library(lib) is None]
    if missing:
        return f"needs {', '.join(missing)}: run `apt-get install -y {' '.join(missing)}` (as root)"
    return None


def _is_mooncake_test(item) -> bool:
    return "mooncake" in item.keywords or "mooncake" in item.nodeid.lower()


def pytest_collection_modifyitems(config, items):
    from engine.core.device import cuda_available

    if not cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    reason = mooncake_missing()
    if reason:
        skip_mc = pytest.mark.skip(reason=reason)
        for item in items:
            if _is_mooncake_test(item):
                item.add_marker(skip_mc)


# -- L3 backends: one contract, every implementation (memory, file, a real mooncake_master) --------
@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from tests.mooncake_master import MooncakeMaster

    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.stop()


@pytest.fixture(scope="module", params=["memory", "file", "mooncake"])
def backend(request, tmp_path_factory):
    """Each L3 backend in turn (module-scoped: the tests use fresh keys)."""
    from engine.storage.backends.file import FileBackend
    from engine.storage.backends.memory import MemoryBackend
    from engine.storage.backends.mooncake import MooncakeBackend
    from engine.storage.config import FileStoreConfig

    if request.param == "memory":
        b = MemoryBackend()
    elif request.param == "file":
        b = FileBackend(FileStoreConfig(dir=str(tmp_path_factory.mktemp("store"))))
    else:
        b = MooncakeBackend(request.getfixturevalue("master").config())
    yield b
    b.close()
