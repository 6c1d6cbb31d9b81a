"""Parameter-shape lists of real models, generated in code (no model download)."""

from __future__ import annotations


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision ResNet-50: ~25.6M parameters in 161 tensors."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]

    def conv_bn(out_ch: int, in_ch: int, k: int) -> None:
        shapes.extend([(out_ch, in_ch, k, k), (out_ch,), (out_ch,)])

    in_ch = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            conv_bn(width, in_ch, 1)
            conv_bn(width, width, 3)
            conv_bn(width * 4, width, 1)
            if b == 0:
                conv_bn(width * 4, in_ch, 1)
            in_ch = width * 4
    shapes.extend([(1000, 2048), (1000,)])
    return shapes


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small (tied head): ~124M parameters in 148 tensors."""
    d, vocab, ctx = 768, 50257, 1024
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


MODELS = {"resnet50": resnet50_shapes, "gpt2_small": gpt2_small_shapes}


def tiny_shapes(count: int = 2000) -> list[tuple[int, ...]]:
    """Many small tensors (16 to 2,015 elements, ~2M in all): launch and metadata overhead dominate."""
    return [(16 + (i * 97) % 2000,) for i in range(count)]


GPU_SHAPES = {**MODELS, "tiny2000": tiny_shapes}
