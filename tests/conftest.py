"""Shared pytest setup: GPU tests run where a CUDA device exists and are skipped elsewhere."""

import os

# Before torch loads: spin-waiting OpenMP threads slow to a crawl when the test's server and
# client share the 2 cores of a CI machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    from engine.device import cuda_available

    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
