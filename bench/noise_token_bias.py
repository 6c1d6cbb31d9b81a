"""How much a token budget's length-sorted micro-batches bias the noise scale's ``S``.

Run: ``python bench/noise_token_bias.py`` (``--help``). The estimator of ``S`` (docs/noise-scale.md)
assumes each micro-batch is a random part of the mini-batch. A token budget (``micro_batch_tokens``)
is not: it sorts rows by length, so each micro-batch holds rows of similar length, and where the
gradient depends on the length the spread between micro-batches includes the spread between
lengths. Here a tiny language model at fixed weights (the optimizer's learning rate is 0) reads
rows whose tokens depend on their length (short rows draw from the lower half of the vocabulary,
long rows from the upper half: the gradient is tied to the length on purpose), or, as a control,
rows whose tokens do not. Each step draws a random mini-batch of ``--batch`` rows and the
estimate ``S`` of that step is kept, over ``--steps`` steps, for:

* ``rows``: micro-batches of ``--rows`` rows in the mini-batch's random order (a random split),
  weighted by their tokens (``normalize=`` the label tokens): the reference;
* ``tokens``: the same mini-batches under ``micro_batch_tokens=--tokens`` (length-sorted).

Reported: the mean ``S`` of each with its standard error and their ratio. Written as
``noise_token_bias.{json,md}`` where bench/_results.py says studies write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402

import mbs_ext  # noqa: E402

VOCAB, WIDTH = 64, 48


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _rows(n: int, tied: bool, seed: int) -> dict[str, torch.Tensor]:
    """``n`` right-padded rows of 2 to WIDTH tokens (log-uniform lengths); with ``tied`` a row's
    tokens come from the half of the vocabulary its length picks, otherwise from all of it."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.empty(n).uniform_(0.7, float(torch.log(torch.tensor(WIDTH))), generator=g)).long()
    lengths = lengths.clamp(2, WIDTH)
    ids = torch.zeros(n, WIDTH, dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        low = (VOCAB // 2 if length > WIDTH // 4 else 0) if tied else 0
        high = low + (VOCAB // 2 if tied else VOCAB)
        ids[i, :length] = torch.randint(low, high, (length,), generator=g)
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), ids.roll(-1, dims=1), torch.full_like(ids, -100))
    labels[torch.arange(n), lengths - 1] = -100  # the last token has no next one
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(model: nn.Module, mb: dict) -> torch.Tensor:
    logits = model(mb["input_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["labels"].reshape(-1), ignore_index=-100)


def _count(mb: dict) -> torch.Tensor:
    return (mb["labels"] != -100).sum()


def study(tied: bool, args: argparse.Namespace) -> dict:
    data = _rows(args.rows_total, tied, seed=1)
    model = _TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # fixed weights: every step measures one model
    split = {"rows": {"micro_batch_size": args.rows},
             "tokens": {"micro_batch_tokens": args.tokens, "micro_batch_size": 4 * args.rows}}
    streamers = {name: mbs_ext.MicroBatchStreamer(model, opt, _loss, normalize=_count, noise_scale=True,
                                                  check_count=False, **kw) for name, kw in split.items()}
    order = mbs_ext.SampleOrder(args.rows_total, seed=2)
    traces: dict[str, list[float]] = {name: [] for name in split}
    for _ in range(args.steps):
        idx = order.next(args.batch)
        batch = {k: v[idx] for k, v in data.items()}
        for name, streamer in streamers.items():
            noise = streamer.step(batch).noise
            traces[name].append(noise.trace)
    mean = {name: statistics.fmean(t) for name, t in traces.items()}
    err = {name: statistics.stdev(t) / len(t) ** 0.5 for name, t in traces.items()}
    return {"rows": "tied to length" if tied else "independent of length", "S rows split": mean["rows"],
            "+-": err["rows"], "S token budget": mean["tokens"], "+- ": err["tokens"],
            "token / rows": mean["tokens"] / mean["rows"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="rows per mini-batch")
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch of the row split")
    parser.add_argument("--tokens", type=int, default=256, help="the token budget (counting padding)")
    parser.add_argument("--rows-total", type=int, default=2048, help="rows of the data set")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = [study(tied, args) for tied in (True, False)]
    write("noise_token_bias", {"args": vars(args), "rows": table}, table,
          note="Mean S over random mini-batches at fixed weights: a random row split vs a token budget's "
               f"length-sorted micro-batches, {args.steps} steps of {args.batch} rows "
               "(python bench/noise_token_bias.py); +-: standard errors.")


if __name__ == "__main__":
    main()
