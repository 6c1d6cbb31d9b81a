"""Cut a language-model batch by tokens instead of rows (runs on the CPU in seconds; no downloads).

    python examples/tokens_example.py

A batch of 64 rows padded to 256 tokens whose lengths are mostly short, as in real text: a few
long rows set the width. Cut by rows (8 at a time), every micro-batch carries the whole batch's
padding. With ``micro_batch_tokens=1024`` the rows are grouped by length and each micro-batch
is trimmed to its longest row, at most 1024 token positions counting padding. Both steps start
from the same weights and take the same step (the same loss); the token split streams a
fraction of the positions. With ``micro_batch_tokens="auto"`` and ``memory_budget=`` the budget
is planned from measured memory instead (docs/tokens.md).
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import mbs_ext
from mbs_ext.integrations.transformers import label_token_count

ROWS, WIDTH, VOCAB = 64, 256, 100


def padded_batch() -> dict:
    """Right-padded rows with log-normal lengths (median about 24 tokens); labels -100 on padding."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(3.2 + 0.8 * torch.randn(ROWS, generator=g)).long().clamp(2, WIDTH)
    mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (ROWS, WIDTH), generator=g).masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def lm_loss(model, micro_batch):
    return model(**micro_batch).loss


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batch = padded_batch()
    lengths = batch["attention_mask"].sum(1)
    by_rows = GPT2LMHeadModel(config)
    by_rows.loss_type = "ForCausalLM"  # what transformers maps GPT-2 to, said explicitly (no warning)
    by_tokens = copy.deepcopy(by_rows)
    # The loss averages over the label tokens after the causal shift: each micro-batch weighs by its own.
    count = label_token_count(shifted=True)
    runs = {}
    for name, model, split in (("rows", by_rows, {"micro_batch_size": 8}),
                               ("tokens", by_tokens, {"micro_batch_tokens": 1024})):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = time.perf_counter()
        result = mbs_ext.step(model, opt, batch, lm_loss, normalize=count, **split)
        runs[name] = (result, time.perf_counter() - start)
    plan = mbs_ext.plan_tokens(lengths, 1024)
    rows, rows_s = runs["rows"]
    tokens, tokens_s = runs["tokens"]
    real = int(lengths.sum())
    print(f"{ROWS} rows padded to {WIDTH}: {real} real tokens of {ROWS * WIDTH} positions")
    print(f"by rows:   {rows.num_micro_batches} micro-batches, {ROWS * WIDTH} positions streamed, "
          f"loss {rows.loss:.6f}, {rows_s:.2f} s")
    streamed = sum(s * w for s, w in zip(plan.sizes, plan.widths))
    print(f"by tokens: {tokens.num_micro_batches} micro-batches, {streamed} positions streamed "
          f"(padding {plan.padding:.0%}), loss {tokens.loss:.6f}, {tokens_s:.2f} s")
    gap = max(((p - q).norm() / q.norm()).item() for p, q in zip(by_rows.parameters(), by_tokens.parameters()))
    print(f"largest relative difference between the two models' weights after the step: {gap:.1e} (float32)")
    print("(times: one measurement on whatever else this machine runs, not a benchmark: bench/bench_tokens.py)")


if __name__ == "__main__":
    main()
