"""Micro-batches shaped by tokens on a GPU: a row split vs ``micro_batch_tokens`` budgets.

The GPU counterpart of ``bench_tokens.py``: a 6-layer GPT-2 (n_embd 512) from transformers,
256 rows padded to 1,024 tokens with log-normal lengths around 160 (about a sixth of the
positions real), held on the host and streamed to the GPU. The row split streams 16 rows per
micro-batch at full width; the token budgets group rows by length and trim each micro-batch to
its longest row. Both normalize by the count of real tokens. Per variant: the median step
time of interleaved rounds (each between two synchronizes), the peak of
``torch.cuda.max_memory_allocated`` above the step's start, the micro-batch count, and the
first step's loss, every variant from the same weights (float32, TF32 off). Results where
``bench/_results.py:results_dir("gpu")`` says. Skipped without a GPU.

    python -m pytest bench/bench_tokens_gpu.py -q -s
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from _cuda import peak_above_start, rotating_medians
from _results import write

import mbs_ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
transformers = pytest.importorskip("transformers")
from bench_tokens import count, gpt2, loss_fn, pad  # noqa: E402 - needs transformers

N, WIDTH, VOCAB, ROWS = 256, 1024, 8192, 16
BUDGETS = (8192, 16384, 32768)
ROUNDS = int(os.environ.get("MBS_BENCH_ROUNDS", "7"))


def padded_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(N, generator=g) * 0.6 + torch.tensor(160.0).log()).exp().round().clamp(1, WIDTH).long()
    return pad(lengths, WIDTH, VOCAB, g)


def test_token_budget_gpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = padded_batch()
    base = gpt2(VOCAB, WIDTH, n_embd=512, n_layer=6, n_head=8).cuda()
    splits = {f"rows m={ROWS}": {"micro_batch_size": ROWS}}
    splits |= {f"tokens T={t}": {"micro_batch_tokens": t} for t in BUDGETS}
    runs, losses, counts = {}, {}, {}
    for name, split in splits.items():
        model = copy.deepcopy(base)
        streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=1e-3), loss_fn,
                                              normalize=count, **split)
        losses[name] = streamer.step(batch).loss  # first step from the shared weights; also the warm-up
        counts[name] = (mbs_ext.plan_tokens(batch["attention_mask"].sum(1), split["micro_batch_tokens"])
                        .num_micro_batches if "micro_batch_tokens" in split else N // ROWS)
        runs[name] = lambda streamer=streamer: streamer.step(batch)
    med = rotating_medians(runs, ROUNDS)
    peaks = {k: peak_above_start(run) for k, run in runs.items()}
    rows_name = next(iter(runs))
    table = [{"split": k, "median_ms": med[k] * 1e3, "time / rows": med[k] / med[rows_name],
              "peak_MiB": peaks[k] / 2**20, "micro_batches": counts[k], "loss": losses[k]} for k in runs]
    write("tokens_gpu", {"N": N, "width": WIDTH, "rows": ROWS, "budgets": list(BUDGETS), "rounds": ROUNDS,
                         "real_tokens": int(batch["attention_mask"].sum()), "medians_s": med, "losses": losses,
                         "peak_bytes": peaks}, table,
          note=f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 6-layer GPT-2 (n_embd 512), {N} rows "
               f"padded to {WIDTH} tokens, log-normal lengths around 160, pageable host batch; medians of {ROUNDS} "
               "interleaved rounds after one warm-up step; peak = max_memory_allocated above the step's start; "
               "loss = each variant's first step, from the same weights (float32, TF32 off).")
    for k in runs:
        assert losses[k] == pytest.approx(losses[rows_name], rel=1e-4), k  # the same step, to float32 precision
