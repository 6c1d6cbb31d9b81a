"""Micro-batches shaped by tokens: step time of a row split vs ``micro_batch_tokens`` budgets.

A 2-layer GPT-2 on the CPU, 64 rows padded to 512 tokens. Two length distributions: log-normal
around 80 tokens (about 19% of the padded positions real, what language-model batches padded to
a fixed length look like) and uniform over [1, 512] (half real). The row split streams 8 rows
per micro-batch at full width; the token budgets group rows by length and trim each micro-batch
to its longest row. Per variant: the median step time of interleaved rounds, the micro-batch
count and the fraction of streamed positions that are padding; every variant's first step
starts from the same weights, so their losses are compared (float32).
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
from _results import interleaved, results_dir, write

import mbs_ext

transformers = pytest.importorskip("transformers")

N, WIDTH, VOCAB, ROWS = 64, 512, 1000, 8
BUDGETS = (1024, 2048, 4096, 8192)
ROUNDS = 3
THREADS = 1  # on a shared machine, two threads wait at every operation's barrier for a core
TARGET = 0.35  # the token step at T=4096 takes at most this fraction of the row split's time


def lengths_of(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "lognormal80":
        return (torch.randn(N, generator=g) * 0.6 + torch.tensor(80.0).log()).exp().round().clamp(1, WIDTH).long()
    return torch.randint(1, WIDTH + 1, (N,), generator=g)


def padded_batch(kind: str) -> dict:
    return pad(lengths_of(kind), WIDTH, VOCAB, torch.Generator().manual_seed(1))


def pad(lengths: torch.Tensor, width: int, vocab: int, g: torch.Generator) -> dict:
    """Random token rows of ``lengths`` padded to ``width``: ids, attention mask, labels (-100 on padding)."""
    real = torch.arange(width) < lengths[:, None]
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g).masked_fill(~real, 0)
    return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~real, -100)}


def gpt2(vocab: int = VOCAB, width: int = WIDTH, n_embd: int = 128, n_layer: int = 2,
         n_head: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=width, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def loss_fn(model, batch):
    return model(**batch).loss


def count(batch):
    return (batch["labels"][:, 1:] != -100).sum()


def variants(batch: dict) -> tuple[dict, dict, dict]:
    """Name -> one step; name -> the split's micro-batches and padding; name -> first-step losses."""
    base = gpt2()
    runs, shape, losses = {}, {}, {}
    real = int(batch["attention_mask"].sum())
    splits = {f"rows m={ROWS}": {"micro_batch_size": ROWS}}
    splits |= {f"tokens T={t}": {"micro_batch_tokens": t} for t in BUDGETS}
    for name, split in splits.items():
        model = copy.deepcopy(base)
        streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=1e-3), loss_fn,
                                              normalize=count, **split)

        def run(streamer=streamer, name=name):
            result = streamer.step(batch)
            losses.setdefault(name, result.loss)

        runs[name] = run
        if "micro_batch_tokens" in split:
            plan = mbs_ext.plan_tokens(batch["attention_mask"].sum(1), split["micro_batch_tokens"])
            shape[name] = (plan.num_micro_batches, plan.padding)
        else:
            shape[name] = (N // ROWS, 1 - real / (N * WIDTH))
    return runs, shape, losses


@pytest.mark.parametrize("kind", ["lognormal80", "uniform"])
def test_token_budget_study(benchmark, kind):
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        study(benchmark, kind)
    finally:
        torch.set_num_threads(threads)


def study(benchmark, kind: str) -> None:
    batch = padded_batch(kind)
    runs, shape, losses = variants(batch)
    times: dict[str, list[float]] = {k: [] for k in runs}
    benchmark.group = f"tokens {kind} (one round = every variant once)"
    benchmark.pedantic(interleaved(runs, times), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    times = {k: v[1:] for k, v in times.items()}  # the warm-up round is recorded too: not counted
    med = {k: statistics.median(v) for k, v in times.items()}
    rows_name = f"rows m={ROWS}"
    table = [{"split": k, "median_s": med[k], "time / rows": med[k] / med[rows_name],
              "micro_batches": shape[k][0], "padding": shape[k][1], "loss": losses[k]} for k in runs]
    for k, v in med.items():
        benchmark.extra_info[f"{k}_median_s"] = v
    write(f"tokens_{kind}", {"N": N, "width": WIDTH, "rows": ROWS, "budgets": list(BUDGETS), "rounds": ROUNDS,
                             "real_tokens": int(batch["attention_mask"].sum()), "medians_s": med, "losses": losses,
                             "shapes": shape}, table,
          note=f"2-layer GPT-2 (n_embd 128), {N} rows padded to {WIDTH} tokens, lengths {kind}, CPU "
               f"({torch.get_num_threads()} threads); medians of {ROUNDS} interleaved rounds after one warm-up; "
               "padding = fraction of streamed token positions that are padding; loss = each variant's first "
               "step, from the same weights.")
    plot(kind, table)
    for k in runs:
        assert losses[k] == pytest.approx(losses[rows_name], rel=1e-5), k  # the same step, to float32 precision
    if kind == "lognormal80":
        assert med["tokens T=4096"] <= TARGET * med[rows_name], med


def plot(kind: str, table: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the table is the result
        return
    budgets = [r for r in table if r["split"].startswith("tokens")]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([int(r["split"].split("=")[1]) for r in budgets], [r["median_s"] for r in budgets], "o-",
            label="grouped by length, trimmed")
    ax.axhline(table[0]["median_s"], color="gray", ls="--", label=f"row split, {ROWS} rows")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro_batch_tokens (rows x width)")
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"GPT-2 step, {N} rows padded to {WIDTH}, lengths {kind}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / f"tokens_{kind}.png", dpi=100)
    plt.close(fig)
