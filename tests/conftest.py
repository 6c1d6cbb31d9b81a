"""Shared test fixtures: the devices to run on (CUDA only where a GPU and a CUDA build exist)."""

from __future__ import annotations

import pytest
from common import CUDA, DEVICE_PARAMS, requires_cuda

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

__all__ = ["DEVICES", "device", "requires_cuda"]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> str:
    """"cpu", and "cuda" where available (skipped cleanly otherwise)."""
    return request.param
