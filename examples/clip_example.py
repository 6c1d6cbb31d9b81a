"""CLIP-style contrastive training, streamed: CachedLoss takes the full batch's step, plain streaming does not.

    python examples/clip_example.py [--steps 30] [--out clip_example]

Two towers embed two views of scikit-learn's digits (the 8x8 image, and its row and column
ink profiles, a second "modality"); a symmetric InfoNCE loss with a learned temperature scores
every image against every profile of the mini-batch, so each row's loss depends on all the
others: the in-batch negatives. The mini-batch of 512 rows streams in micro-batches of 64, so
autograd holds an eighth of the full batch's activations (printed). Three models start from the
same weights and see the same mini-batches:

* full batch: one ``loss.backward()`` on all 512 rows (the reference);
* ``mbs_ext.CachedLoss(encode, info_nce)``: streamed, the full batch's step;
* plain streaming of the same loss per micro-batch: each micro-batch sees only its own 63
  negatives, a different (easier) loss, and a different model.

Float64, so that "the same step" is visible to rounding. Writes ``clip_example.png``: the loss
each step reports (plain streaming reports the micro-batches' own, easier loss: no error, no
warning), and how far each model's weights are from the full-batch model's.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import measure_saved_bytes, pyplot

ROWS, MICRO = 512, 64


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
        self.profile = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.log_temperature = nn.Parameter(torch.tensor(-1.0))  # used by the loss only
        self.double()


def encode(model: Towers, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model.image(mb["image"]), model.profile(mb["profile"])


def info_nce(model: Towers, encoded: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    a, b = (F.normalize(t, dim=1) for t in encoded)
    logits = a @ b.t() / model.log_temperature.exp()
    target = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def pairs() -> dict:
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float64) / 16.0  # 1797 x 8 x 8
    noise = torch.Generator().manual_seed(1)
    images = images + 0.05 * torch.randn(images.shape, generator=noise, dtype=torch.float64)
    profile = torch.cat([images.sum(1), images.sum(2)], dim=1) / 8.0
    return {"image": images.flatten(1), "profile": profile}


@torch.no_grad()
def distance(model: nn.Module, ref: nn.Module) -> float:
    """Relative distance of all weights from the reference model's."""
    diff = sum(((p - q) ** 2).sum() for p, q in zip(model.parameters(), ref.parameters()))
    return float((diff / sum((q**2).sum() for q in ref.parameters())).sqrt())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--out", default="clip_example", help="folder for clip_example.png")
    args = parser.parse_args(argv)
    data = pairs()
    models = {"full batch": Towers()}
    models["CachedLoss"] = copy.deepcopy(models["full batch"])
    models["plain streaming"] = copy.deepcopy(models["full batch"])
    opts = {name: torch.optim.Adam(m.parameters(), lr=3e-3) for name, m in models.items()}
    cached = mbs_ext.CachedLoss(encode, info_nce)
    losses = {name: [] for name in models}
    gaps = {name: [] for name in models if name != "full batch"}
    order = torch.randperm(len(data["image"]), generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        rows = order[(step * ROWS) % (len(order) - ROWS):][:ROWS]
        batch = {k: v[rows] for k, v in data.items()}
        full, opt = models["full batch"], opts["full batch"]
        opt.zero_grad()
        loss = info_nce(full, encode(full, batch))
        loss.backward()
        opt.step()
        losses["full batch"].append(loss.item())
        r = mbs_ext.step(models["CachedLoss"], opts["CachedLoss"], batch, cached, micro_batch_size=MICRO)
        losses["CachedLoss"].append(r.loss)
        r = mbs_ext.step(models["plain streaming"], opts["plain streaming"], batch,
                         lambda m, mb: info_nce(m, encode(m, mb)), micro_batch_size=MICRO)
        losses["plain streaming"].append(r.loss)  # the mean of the micro-batches' own InfoNCE
        for name in gaps:
            gaps[name].append(distance(models[name], full))

    first = {k: v[:MICRO] for k, v in batch.items()}
    saved = (measure_saved_bytes(full, batch, lambda m, b: info_nce(m, encode(m, b))),
             measure_saved_bytes(full, first, lambda m, b: info_nce(m, encode(m, b))))
    print(f"activations autograd holds: full batch of {ROWS} rows {saved[0] / 2**10:.0f} KiB, "
          f"a micro-batch of {MICRO} {saved[1] / 2**10:.0f} KiB")
    for name in models:
        print(f"{name:16s} loss the last step reported: {losses[name][-1]:.6f}")
    print(f"largest distance from the full-batch model's weights: CachedLoss {max(gaps['CachedLoss']):.1e}, "
          f"plain streaming {max(gaps['plain streaming']):.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(losses, gaps, out / "clip_example.png")
    print(f"wrote {out / 'clip_example.png'}")


def _plot(losses: dict, gaps: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"full batch": ("k", "--", 1.2), "CachedLoss": ("C0", "-", 3.0), "plain streaming": ("C3", "-", 1.5)}
    for name, curve in losses.items():
        color, line, width = styles[name]
        ax_loss.plot(curve, line, color=color, lw=width, alpha=0.8, label=name)
    ax_loss.set(xlabel="optimizer step", ylabel="InfoNCE", title="the loss each step reports")
    ax_loss.legend()
    for name, curve in gaps.items():
        color, line, width = styles[name]
        ax_gap.plot(range(1, len(curve) + 1), [max(g, 1e-18) for g in curve], line, color=color, lw=width,
                    label=name)
    ax_gap.set(xlabel="optimizer step", ylabel="relative distance of the weights", yscale="log",
               title="distance from the full-batch model")
    ax_gap.legend()
    fig.suptitle(f"in-batch negatives, {ROWS} rows streamed {MICRO} at a time (float64)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
