"""Small real data sets that ship with installed packages (nothing is downloaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def load_digits(size: int = 32, seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits, upsampled to ``size`` x ``size``, split stratified by ``seed``.

    Returns ``(x_train, y_train, x_test, y_test)``: float32 NCHW images scaled to
    [-1, 1] and int64 labels. Upsampling makes activations large enough for memory
    to matter. The demo and the Table 4 miniature both train on this.
    """
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - the demo/test extras install it
        raise ImportError("the digits data needs scikit-learn: pip install 'mbs_ext[demo]'") from exc
    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train, test = train_test_split(
        list(range(len(labels))), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    train, test = torch.tensor(train), torch.tensor(test)
    return images[train].contiguous(), labels[train].contiguous(), images[test].contiguous(), labels[test].contiguous()


def small_cnn(image_size: int = 32, seed: int | None = None, width: int = 16, num_classes: int = 10,
              batchnorm: bool = False) -> nn.Module:
    """A CNN for 1 x image_size x image_size inputs whose activations (about 270 KB a sample at
    32x32) dwarf its weights; BatchNorm-free unless ``batchnorm`` puts an ``nn.BatchNorm2d`` after
    each convolution (before its ReLU). ``seed`` reseeds torch first when given."""
    if seed is not None:
        torch.manual_seed(seed)
    side = image_size // 4
    layers: list[nn.Module] = []
    for c_in, c_out in ((1, width), (width, 2 * width)):
        layers.append(nn.Conv2d(c_in, c_out, 3, padding=1))
        if batchnorm:
            layers.append(nn.BatchNorm2d(c_out))
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(2 * width * side * side, 64), nn.ReLU(),
                         nn.Linear(64, num_classes))


def small_bn_cnn(image_size: int = 32, seed: int | None = None, width: int = 16, num_classes: int = 10) -> nn.Module:
    """:func:`small_cnn` with an ``nn.BatchNorm2d`` after each convolution (before its ReLU).

    Plain BatchNorm: :func:`mbs_ext.step` defers its running statistics by itself (one commit
    per mini-batch; each micro-batch is normalized with its own statistics and the step warns
    once, :class:`mbs_ext.BatchNormWarning`)."""
    return small_cnn(image_size, seed, width, num_classes, batchnorm=True)


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
