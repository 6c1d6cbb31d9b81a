"""Shared reference implementations and comparisons for the step tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def full_batch_step(model, optimizer, batch, loss_fn, scaler=None, max_grad_norm=None):
    """The reference: one ordinary backward over the whole mini-batch."""
    optimizer.zero_grad()
    loss = loss_fn(model, batch)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    norm = None
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return loss.item(), norm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double()
    b = b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def assert_models_match(model, ref, tol: float) -> None:
    """Same grads (None where the reference has None) and the same parameters."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: expected no grad"
        else:
            assert p.grad is not None, f"{name}: missing grad"
            assert rel_err(p.grad, q.grad) <= tol, f"{name}: grad rel err {rel_err(p.grad, q.grad)}"
        assert rel_err(p, q) <= tol, f"{name}: param rel err {rel_err(p, q)}"


def snapshot(model, optimizer=None, scaler=None) -> dict:
    """Bit-exact copies of everything a step may change."""
    snap = {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
    }
    if optimizer is not None:
        st = optimizer.state_dict()
        snap["opt"] = {
            k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
            for k, v in st["state"].items()
        }
        snap["opt_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in st["param_groups"]]
    if scaler is not None:
        snap["scaler"] = scaler.state_dict()
    return snap


def assert_bit_identical(a: dict, b: dict) -> None:
    def same(x, y, where):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, where
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), where
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), where
            for k in x:
                same(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, list):
            assert len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                same(u, v, f"{where}[{i}]")
        else:
            assert x == y, where

    same(a, b, "state")


# --- a token-masked causal-LM-like model ---------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def lm_loss(model, batch):
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def token_count(batch):
    return (batch["labels"] != -100).sum()
