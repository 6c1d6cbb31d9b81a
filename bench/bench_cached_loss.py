"""CachedLoss: time and memory of an exact contrastive step vs the full batch and plain streaming.

A sequence encoder (embedding, one transformer layer, mean pooling, projection) trained with
InfoNCE over in-batch negatives, B rows of T tokens, on the CPU. Three steps side by side:
the full batch (one backward over everything), ``mbs_ext.step`` with ``CachedLoss`` (exact),
and ``mbs_ext.step`` with the same InfoNCE applied per micro-batch (plain streaming: the
same compute shape minus the extra no-grad forward, and wrong). Time: medians of interleaved
rounds. Memory: the peak of live tensor bytes during one step (``PeakTracker``, the CPU
allocator's view, so a property of the code, not of the machine's load).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from _results import interleaved, write
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import PeakTracker

B, T, VOCAB, M = 512, 32, 1000, 32
ROUNDS = 7


class Encoder(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.proj = nn.Linear(d, 32)
        self.log_temperature = nn.Parameter(torch.tensor(-2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.layer(self.tok(ids)).mean(1))


def encode(model: Encoder, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model(mb["a"]), model(mb["b"])


def info_nce(model: Encoder, enc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    a, b = (F.normalize(t, dim=1) for t in enc)
    logits = a @ b.t() / model.log_temperature.exp()
    return F.cross_entropy(logits, torch.arange(a.shape[0], device=logits.device))


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (B, T), generator=g)
    return {"a": a, "b": a.roll(1, 1)}


def runs() -> dict:
    data = batch()
    models = {k: Encoder() for k in ("full", "cached", "plain")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def full() -> None:
        opts["full"].zero_grad(set_to_none=True)
        info_nce(models["full"], encode(models["full"], data)).backward()
        opts["full"].step()

    cached = mbs_ext.MicroBatchStreamer(models["cached"], opts["cached"], mbs_ext.CachedLoss(encode, info_nce),
                                        micro_batch_size=M)
    plain = mbs_ext.MicroBatchStreamer(models["plain"], opts["plain"],
                                       lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=M)
    return {"full": full, "cached": lambda: cached.step(data), "plain": lambda: plain.step(data)}


def peak_bytes(run) -> int:
    run()  # warm: optimizer state, rings
    with PeakTracker() as tracker:
        run()
    return tracker.peak


def test_cached_loss_study() -> None:
    variants = runs()
    times: dict[str, list[float]] = {k: [] for k in variants}
    one_round = interleaved(variants, times)
    one_round()  # warm-up round, not counted
    times = {k: [] for k in variants}
    one_round = interleaved(variants, times)
    for _ in range(ROUNDS):
        one_round()
    med = {k: statistics.median(v) for k, v in times.items()}
    peaks = {k: peak_bytes(run) for k, run in runs().items()}
    rows = [{"step": k, "median_ms": med[k] * 1e3, "time / plain": med[k] / med["plain"],
             "peak_MiB": peaks[k] / 2**20, "peak / full": peaks[k] / peaks["full"]} for k in variants]
    write("cached_loss", {"B": B, "T": T, "micro_batch_size": M, "rounds": ROUNDS, "medians_s": med,
                          "peak_bytes": peaks}, rows,
          note=f"InfoNCE over {B} rows x {T} tokens, micro-batches of {M}, CPU; medians of {ROUNDS} interleaved "
               "rounds; peak = live tensor bytes during one step (PeakTracker). `plain` is the per-micro-batch "
               "loss: the same compute without the extra no-grad forward, and not the full batch's gradient.")
    for r in rows:
        print(r)
    assert peaks["cached"] < peaks["full"]  # what the study exists to show: one micro-batch's activations
