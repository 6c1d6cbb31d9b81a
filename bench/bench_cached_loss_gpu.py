"""CachedLoss on a GPU: an exact contrastive step against the full batch and plain streaming.

A sequence encoder (embedding, two transformer layers, mean pooling, projection) trained with
InfoNCE over in-batch negatives, B rows of T tokens held on the host (pageable), micro-batches
of M rows streamed to the GPU. Three steps side by side, each from the same weights:

* ``full``: the whole batch copied to the GPU, one forward and one backward (the reference);
* ``cached``: ``mbs_ext.step`` with ``CachedLoss`` (exact: a no-grad pass for the encodings,
  the loss on all of them, then a streamed pass that feeds each micro-batch its rows' gradient);
* ``plain``: ``mbs_ext.step`` with InfoNCE per micro-batch (the same streamed compute minus the
  no-grad pass, and not the full batch's gradient).

Reported: the median step time of interleaved rounds (each between two synchronizes), the peak
of ``torch.cuda.max_memory_allocated`` above what one step starts with, and each step's largest
gradient difference from the full batch's, relative to the largest gradient (TF32 off, float32).
Results where ``bench/_results.py:results_dir("gpu")`` says. Skipped without a GPU.

    python -m pytest bench/bench_cached_loss_gpu.py -q -s
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from _cuda import peak_above_start, rotating_medians
from _results import write
from bench_cached_loss import encode, info_nce
from torch import nn

import mbs_ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B, T, VOCAB, M, D = 4096, 64, 8192, 256, 256
ROUNDS = int(os.environ.get("MBS_BENCH_ROUNDS", "7"))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.proj = nn.Linear(D, 128)
        self.log_temperature = nn.Parameter(torch.tensor(-2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.layers(self.tok(ids)).mean(1))


def host_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (B, T), generator=g)
    return {"a": a, "b": a.roll(1, 1)}


def steps(data: dict) -> tuple[dict, dict]:
    """Name -> one optimizer step; name -> the model it trains (all start from one set of weights)."""
    base = Encoder().cuda()
    models = {k: copy.deepcopy(base) for k in ("full", "cached", "plain")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.0) for k, m in models.items()}  # lr 0: weights stay equal

    def full() -> None:
        gpu = {k: v.cuda(non_blocking=False) for k, v in data.items()}
        opts["full"].zero_grad(set_to_none=True)
        info_nce(models["full"], encode(models["full"], gpu)).backward()
        opts["full"].step()

    cached = mbs_ext.MicroBatchStreamer(models["cached"], opts["cached"], mbs_ext.CachedLoss(encode, info_nce),
                                        micro_batch_size=M)
    plain = mbs_ext.MicroBatchStreamer(models["plain"], opts["plain"],
                                       lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=M)
    return {"full": full, "cached": lambda: cached.step(data), "plain": lambda: plain.step(data)}, models


def gradient_error(model: nn.Module, reference: nn.Module) -> float:
    scale = max(float(p.grad.abs().max()) for p in reference.parameters())
    return max(float((p.grad - r.grad).abs().max()) for p, r in zip(model.parameters(), reference.parameters())) / scale


def test_cached_loss_gpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data = host_batch()
    runs, models = steps(data)
    for run in runs.values():  # warm-up: kernels, rings, buffers
        run()
    errors = {k: gradient_error(models[k], models["full"]) for k in runs}
    med = rotating_medians(runs, ROUNDS)
    peaks = {k: peak_above_start(run) for k, run in runs.items()}
    rows = [{"step": k, "median_ms": med[k] * 1e3, "time / full": med[k] / med["full"],
             "time / plain": med[k] / med["plain"], "peak_MiB": peaks[k] / 2**20,
             "peak / full": peaks[k] / peaks["full"], "grad error vs full": errors[k]} for k in runs]
    write("cached_loss_gpu", {"B": B, "T": T, "micro_batch_size": M, "rounds": ROUNDS, "medians_s": med,
                              "peak_bytes": peaks, "gradient_error": errors}, rows,
          note=f"{torch.cuda.get_device_name()}, torch {torch.__version__}; InfoNCE over {B} rows x {T} tokens "
               f"(2-layer encoder, d={D}), micro-batches of {M} from pageable host memory; medians of {ROUNDS} "
               "interleaved rounds after one warm-up; peak = max_memory_allocated above the step's start; "
               "grad error = max |grad - full grad| / max |full grad| (float32, TF32 off).")
    assert errors["cached"] < 1e-4, errors  # exact, to float32 precision
    assert errors["plain"] > 1e-2, errors  # the per-micro-batch loss is another gradient
    assert peaks["cached"] < peaks["full"], peaks
