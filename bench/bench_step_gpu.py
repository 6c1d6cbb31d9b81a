"""GPU step overhead and host syncs: mbs_ext.step vs a full-batch step and a hand-written loop.

Workloads (issue "a GPU step with no per-micro-batch host sync"):

* ResNet-50 fp32 (TF32) and bf16 autocast, B=256 split into m=64 (torchvision needed);
* a GPT-2-small-sized causal LM in plain torch (12 layers, d=768, vocab 50257) under
  bf16 autocast, B=32, T=512, m=8, loss averaged over non-ignored tokens: ``step`` with
  a token-count callable (the count stays on the device) and with ``"samples"``, against
  a hand loop that counts tokens on the host before streaming.

Every variant runs interleaved with the others, each step timed between two
``torch.cuda.synchronize()``, after warm-up; medians over rounds. Host syncs per step
are counted with ``torch.cuda.set_sync_debug_mode("warn")`` at 4 and 32 micro-batches.
Results: JSON + Markdown where ``bench/_results.py:results_dir("gpu")`` says (``$MBS_BENCH_OUT``;
``bench/results/gpu/`` with ``MBS_BENCH_UPDATE=1``; else a scratch folder).
Skipped without a GPU.

    python -m pytest bench/bench_step_gpu.py -q -s
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _cuda import timed
from torch import nn

import mbs_ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROUNDS = int(os.environ.get("MBS_BENCH_ROUNDS", "7"))
WARMUP = 2
IGNORE = -100


class CausalLM(nn.Module):
    """A GPT-2-small-sized decoder (pre-norm, learned positions, tied embeddings)."""

    def __init__(self, vocab: int = 50257, d: int = 768, layers: int = 12, heads: int = 12, T: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.norm(h) @ self.tok.weight.t()


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)


def token_count(batch: dict) -> torch.Tensor:
    return (batch["labels"] != IGNORE).sum()


def lm_batch(B: int, T: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.roll(-1, 1).clone()
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)  # ragged documents: padding ignored
    labels[torch.arange(T)[None, :] >= lengths[:, None]] = IGNORE
    return {"ids": ids, "labels": labels}


def interleave(variants: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per variant, variants alternating within every round."""
    for fn in variants.values():
        for _ in range(WARMUP):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            samples[name].append(timed(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


def full_batch(model, opt, batch, loss_call, autocast_dtype):
    gpu = {k: v.cuda() for k, v in batch.items()} if isinstance(batch, dict) else [t.cuda() for t in batch]

    def run():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_call(model, gpu)
        loss.backward()
        opt.step()
    return run


def hand_loop(model, opt, batch, loss_call, m, autocast_dtype, counts: list[float] | None):
    """The usual accumulation loop, weights from host counts (no sync), pinned copies."""
    pinned = {k: v.pin_memory() for k, v in batch.items()} if isinstance(batch, dict) else [
        t.pin_memory() for t in batch]
    n = next(iter(pinned.values()) if isinstance(pinned, dict) else iter(pinned)).shape[0]
    total = sum(counts) if counts is not None else n

    def run():
        opt.zero_grad(set_to_none=True)
        for i, start in enumerate(range(0, n, m)):
            if isinstance(pinned, dict):
                mb = {k: v[start:start + m].cuda(non_blocking=True) for k, v in pinned.items()}
            else:
                mb = [t[start:start + m].cuda(non_blocking=True) for t in pinned]
            weight = (counts[i] if counts is not None else min(m, n - start)) / total
            with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = loss_call(model, mb)
            (loss * weight).backward()
        opt.step()
    return run


def write(study: str, rows: list[dict], extra: dict) -> None:
    from _results import results_dir

    out = results_dir("gpu")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": ROUNDS}
    (out / f"{study}.json").write_text(json.dumps({"study": study, **meta, **extra, "rows": rows}, indent=2) + "\n")
    cols = list(rows[0]) if rows else []
    lines = [f"# {study}", "", f"{meta['gpu']}, torch {meta['torch']}, medians of {ROUNDS} interleaved rounds", ""]
    if cols:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
                  for r in rows]
    (out / f"{study}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / study}.json and .md")


def _resnet(dtype: torch.dtype | None, B: int = 256, m: int = 64) -> tuple:
    """ResNet-50 (channels_last) on the GPU, its optimizer, loss call and streamer, and a host
    batch of B ImageNet-shaped rows (torchvision needed)."""
    import torchvision

    g = torch.Generator().manual_seed(0)
    batch = [torch.randn(B, 3, 224, 224, generator=g), torch.randint(0, 1000, (B,), generator=g)]
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    ce = nn.CrossEntropyLoss()

    def call(mod, mb):
        return ce(mod(mb[0]), mb[1])

    streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size=m, autocast_dtype=dtype)
    return batch, model, opt, call, streamer


def _resnet_rows() -> list[dict]:
    if importlib.util.find_spec("torchvision") is None:
        return []
    rows = []
    B, m = 256, 64
    for dtype in (None, torch.bfloat16):
        batch, model, opt, call, streamer = _resnet(dtype, B, m)
        # The hand loop copies from a batch pinned once, outside the timing; the step is given
        # the pageable batch (its ring stages it every step) and, as "step_pinned", that same
        # pinned batch: the difference is the staging, not the step's own work.
        pinned = [t.pin_memory() for t in batch]
        med = interleave({
            "full": full_batch(model, opt, batch, call, dtype),
            "hand": hand_loop(model, opt, batch, call, m, dtype, None),
            "step": lambda streamer=streamer, batch=batch: streamer.step(batch),
            "step_pinned": lambda streamer=streamer, pinned=pinned: streamer.step(pinned),
        })
        rows.append({"workload": f"resnet50 {'bf16' if dtype else 'fp32/tf32'} B={B} m={m}",
                     "full_ms": med["full"] * 1e3, "hand_ms": med["hand"] * 1e3, "step_ms": med["step"] * 1e3,
                     "step/hand": med["step"] / med["hand"], "step/full": med["step"] / med["full"],
                     "pinned step/hand": med["step_pinned"] / med["hand"]})
    return rows


def _lm(B: int = 32, T: int = 512, m: int = 8, vocab: int = 50257) -> tuple:
    """The GPT-2-small-sized LM on the GPU, its fused AdamW, a host batch of B ragged rows of T
    tokens, each micro-batch's token count (for the hand loop), and a bf16 streamer that counts
    tokens on the device."""
    batch = lm_batch(B, T, vocab)
    counts = [float((batch["labels"][s:s + m] != IGNORE).sum()) for s in range(0, B, m)]
    torch.manual_seed(0)
    model = CausalLM(vocab=vocab, T=T).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=m, normalize=token_count,
                                        autocast_dtype=torch.bfloat16)
    return batch, counts, model, opt, tokens


def _lm_rows() -> list[dict]:
    B, T, m = 32, 512, 8
    batch, counts, model, opt, tokens = _lm(B, T, m)
    bf16 = torch.bfloat16
    samples = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=m, autocast_dtype=bf16)
    pinned = {k: v.pin_memory() for k, v in batch.items()}
    med = interleave({
        "full": full_batch(model, opt, batch, lm_loss, bf16),
        "hand": hand_loop(model, opt, batch, lm_loss, m, bf16, counts),
        "step_tokens": lambda: tokens.step(batch),
        "step_tokens_pinned": lambda: tokens.step(pinned),
        "step_samples": lambda: samples.step(batch),
    })
    return [{"workload": f"gpt2-small bf16 B={B} T={T} m={m}", "full_ms": med["full"] * 1e3,
             "hand_ms": med["hand"] * 1e3, "step_ms": med["step_tokens"] * 1e3,
             "step/hand": med["step_tokens"] / med["hand"], "step/full": med["step_tokens"] / med["full"],
             "pinned step/hand": med["step_tokens_pinned"] / med["hand"], "samples_step_ms": med["step_samples"] * 1e3}]


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronizations ``fn`` performs, as torch's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _sync_rows() -> list[dict]:
    B, T, vocab = 64, 32, 1000
    batch = lm_batch(B, T, vocab)
    rows = []
    for normalize in ("samples", "tokens"):
        for k in (4, 32):
            torch.manual_seed(0)
            model = CausalLM(vocab=vocab, d=64, layers=2, heads=2, T=T).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            rule = token_count if normalize == "tokens" else "samples"
            streamer = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=B // k, normalize=rule)
            streamer.step(batch)  # warm: ring and buffers exist
            rows.append({"normalize": normalize, "micro_batches": k, "syncs_per_step": count_syncs(
                lambda streamer=streamer: streamer.step(batch))})
    return rows


def test_gpu_step_overhead() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = _resnet_rows() + _lm_rows()
    syncs = _sync_rows()
    write("step_gpu", rows, {"syncs": syncs})
    write("step_gpu_syncs", syncs, {})
    for r in rows + syncs:
        print(r)
    by = {(r["normalize"], r["micro_batches"]): r["syncs_per_step"] for r in syncs}
    # What the study exists to show: syncs do not grow with the number of micro-batches.
    assert all(by[(rule, 32)] <= max(by[(rule, 4)], 2) for rule in ("tokens", "samples")), by


def _profile(runs: dict[str, Callable[[], object]], title: str, filename: str) -> None:
    """torch.profiler's tables of one run of each (by host time and by device time) into ``filename``."""
    from _results import results_dir
    from torch.profiler import ProfilerActivity, profile

    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {title}", ""]
    for name, run in runs.items():
        for _ in range(WARMUP):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        lines += [f"## {name}: by host time", averages.table(sort_by="self_cpu_time_total", row_limit=30), "",
                  f"## {name}: by device time", averages.table(sort_by="self_device_time_total", row_limit=20), ""]
    (results_dir("gpu") / filename).write_text("\n".join(lines) + "\n")


def test_gpu_step_profile() -> None:
    """Where one ResNet-50 fp32 step's time goes, and one GPT-2-small bf16 step's with token
    counts, beside the hand loop's: ``step_gpu_profile.txt``, ``step_gpu_profile_gpt2.txt``."""
    torch.backends.cudnn.allow_tf32 = True
    if importlib.util.find_spec("torchvision") is not None:
        B, m = 256, 64
        batch, model, opt, call, streamer = _resnet(None, B, m)
        _profile({"hand": hand_loop(model, opt, batch, call, m, None, None),
                  "step": lambda: streamer.step(batch)}, f"ResNet-50 fp32/tf32 B={B} m={m}", "step_gpu_profile.txt")
        del model, opt, streamer
    B, T, m = 32, 512, 8
    batch, counts, model, opt, tokens = _lm(B, T, m)
    _profile({"hand": hand_loop(model, opt, batch, lm_loss, m, torch.bfloat16, counts),
              "step": lambda: tokens.step(batch)}, f"GPT-2-small bf16 B={B} T={T} m={m}, token counts",
             "step_gpu_profile_gpt2.txt")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
