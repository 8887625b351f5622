"""Shared pytest setup: GPU tests run where a CUDA device exists and are skipped elsewhere."""

import pytest


def pytest_collection_modifyitems(config, items):
    from engine.device import cuda_available

    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
