"""An Accelerate training loop that streams each mini-batch of 64 rows through the model
8 rows at a time (runs on the CPU in seconds; ``accelerate launch`` for several processes).

    python examples/accelerate_example.py
    accelerate launch --cpu --num_processes 2 examples/accelerate_example.py

``mbs_ext.accumulate`` replaces the forward and ``accelerator.backward``: it leaves the exact
mini-batch gradients in ``.grad`` (normalized over every rank's tokens under DDP, scaled for
the Accelerator's GradScaler under fp16), and the prepared optimizer steps as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import mbs_ext


class TinyLM(nn.Module):
    def __init__(self, vocab=100, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        return self.out(self.mix(self.emb(input_ids)))


def loss_fn(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def tokens(batch):  # what the loss averages over: its non-ignored targets
    return (batch["labels"] != -100).sum()


def dataset(n=512, length=32, vocab=100):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    keep = torch.randint(1, length + 1, (n, 1), generator=g)
    labels = torch.where(torch.arange(length) < keep, torch.roll(ids, -1, 1), -100)
    return torch.utils.data.StackDataset(input_ids=ids, labels=labels)


def main():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=64, shuffle=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = accelerator.prepare_data_loader(loader, device_placement=False)  # batches stay on the host

    model.train()
    for step, batch in enumerate(loader):
        res = mbs_ext.accumulate(model, batch, loss_fn, micro_batch_size=8, normalize=tokens,
                                 scaler=accelerator.scaler)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {res.loss:.4f} ({res.num_micro_batches} micro-batches)")


if __name__ == "__main__":
    main()
