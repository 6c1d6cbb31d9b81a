"""Shared test helpers: the devices to run on (CUDA only where a GPU exists)."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def device(request) -> str:
    return request.param
