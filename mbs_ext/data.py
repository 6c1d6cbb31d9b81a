"""Small real data sets that ship with installed packages (nothing is downloaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def load_digits(size: int = 32, seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits, upsampled to ``size`` x ``size``, split by ``seed``.

    Returns ``(x_train, y_train, x_test, y_test)`` as float32 NCHW images in [0, 1]
    and int64 labels. Upsampling makes activations large enough for memory to matter.
    """
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as exc:  # pragma: no cover - the demo/test extras install it
        raise ImportError("the digits data needs scikit-learn: pip install 'mbs_ext[demo]'") from exc
    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return images[train].contiguous(), labels[train], images[test].contiguous(), labels[test]


def small_cnn(seed: int = 0, width: int = 16) -> nn.Module:
    """A BatchNorm-free CNN for 1x32x32 inputs and 10 classes."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 512) -> float:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(y), chunk):
        logits = model(x[start : start + chunk].to(device))
        correct += int((logits.argmax(1).cpu() == y[start : start + chunk]).sum())
    model.train(was_training)
    return correct / len(y)
