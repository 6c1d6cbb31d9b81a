"""Host reads of device values per step do not grow with the number of micro-batches.

On a GPU every ``.item()``, ``float(t)``, ``bool(t)`` or ``if t:`` is a host sync that
drains the device's queue. They all dispatch ``aten._local_scalar_dense``, so counting
that op under a ``TorchDispatchMode`` finds them on any device, the CPU included
(``tests/test_step_cuda.py`` counts real syncs with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import pytest
import torch
from common import ScalarReads, TinyLM, lm_loss, token_count

import mbs_ext


def lm_batch(n: int, t: int = 7, vocab: int = 11) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    keep = torch.randint(1, t + 1, (n, 1), generator=g)  # unequal token counts per row
    labels = torch.where(torch.arange(t) < keep, torch.roll(ids, -1, dims=1), torch.full_like(ids, -100))
    return {"ids": ids, "labels": labels}


def reads_per_step(normalize, k: int, buffered: bool, device: str) -> int:
    torch.manual_seed(0)
    model = TinyLM().to(device)
    if buffered:
        model = model.bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = lm_batch(32)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=32 // k, normalize=normalize)
    streamer.step(batch)  # warm: the ring and its buffers exist
    with ScalarReads() as mode:
        streamer.step(batch)
    return mode.count


@pytest.mark.parametrize("buffered", [False, True], ids=["grad", "fp32_buffers"])
@pytest.mark.parametrize("normalize", ["samples", token_count], ids=["samples", "tokens"])
def test_scalar_reads_do_not_grow_with_micro_batches(device, normalize, buffered):
    few = reads_per_step(normalize, 4, buffered, device)
    many = reads_per_step(normalize, 32, buffered, device)
    assert few == many, f"{few} scalar reads at 4 micro-batches, {many} at 32"
    assert many <= 1
