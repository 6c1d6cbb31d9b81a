"""The peak memory one streamed step adds, measured by the OS, for a given number of micro-batches.

Streaming exists so that a step's memory follows the micro-batch, not the mini-batch: a step of
1,024 micro-batches must add no more at its peak than one of 8 micro-batches of the same size.
Anything the step keeps per micro-batch (a gradient, a graph, a statistics row, a count, a heap
that fragments as it goes) breaks that, and only a measurement of the whole process sees all of
it. ``tests/test_flat_memory.py`` runs this script at two sizes in fresh processes and compares.

    python bench/flat_memory.py --case plain --k 1024 [--device cpu|cuda]

prints one JSON line: ``rise_mib`` is the step's peak above what was resident just before it
(``kept_mib``: what is still held when it returns; ``cpu_s``: the child's CPU time, imports
included, for sizing a test; ``micro_batches``: what the step reports it streamed).
On the CPU that is ``VmHWM`` (its high-water mark reset by ``5`` into ``/proc/self/clear_refs``)
minus ``VmRSS`` read just before the step, after a garbage collection and ``malloc_trim``; on
CUDA ``torch.cuda.max_memory_allocated()`` (peak statistics reset) minus what was allocated
before the step. Each case builds its model, optimizer and both host batches first (the batch
sits in host memory before the step, as a loader's would), takes one warm-up step of
:data:`WARMUP` micro-batches (optimizer state, ``.grad``, the step's caches, kernels'
first-call allocations, the code of every path a long step takes), then measures one step of
``k`` micro-batches. ``--k 8,1024`` measures a step of each size in turn in the one process,
after the one warm-up (the first micro-batches of the largest size's batch), a JSON line each:
for a case whose heap differs more from process to process than the sizes differ (FSDP2,
tests/test_flat_memory.py).

Deliberately not set: ``MALLOC_*`` (the child runs with glibc's defaults, whose dynamic mmap
threshold moves freed large blocks onto the heap: a heap that grows per micro-batch under
defaults is what users get, so it is part of the property), and ``RssPeak`` is not used, since
it ``mallopt``s the thresholds for good. One torch thread: the figure is the step's, not the
thread pool's.

Two-rank cases (gloo on 127.0.0.1, under ``tests/ddp_harness.py``'s watchdog) measure on
every rank, each its own ``k`` micro-batches; ``rise_mib`` is the largest rank's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import mbs_ext
from mbs_ext.diagnostics import malloc_trim, proc_status

ROOT = Path(__file__).resolve().parent.parent
MIB = float(1 << 20)
M = 2  # rows per micro-batch: k=1,024 stays a few seconds on one core
# Micro-batches of the warm-up step: enough that it runs every code path a long step runs. The
# step's loss ledger folds its block of slots every BLOCK micro-batches and, from the second fold
# on, merges with the earlier marks (mbs_ext/counts/ledger.py); the first time a process runs
# those operations it pages in their code (BLOCK = 128, not exported: bench imports mbs_ext and
# mbs_ext.diagnostics only). Measured on `plain` (smaps of the step, 1,024
# micro-batches after a 4-micro-batch warm-up): +0.9 MiB of libtorch_cpu.so text at micro-batch
# 128, none at k=8: a one-off of the process, not memory the step keeps, which a 4-micro-batch
# warm-up left to the measured step of 1,024 alone. Two folds and a third block: 2 * BLOCK + 4.
LEDGER_BLOCK = 128
WARMUP = 2 * LEDGER_BLOCK + 4
CLASSES = 10
D = 256  # feature width: every parameter tensor is at most D x D float32 = 256 KiB (see _mlp)
LEAK_BYTES = 1 << 19  # what the `leak` control keeps per micro-batch
WORLD_TIMEOUT_S = 240.0  # the two-rank watchdog


@dataclass
class Case:
    """One step as a case takes it (``run(batch)``), the warm-up batch and the measured one.

    ``inherent_bytes``: memory the step needs by nature in proportion to the mini-batch (only
    ``cached_loss``: every row's encodings), reported so that a comparison can take it off."""

    run: Callable[[Any], Any]
    warm: Any
    batch: Any
    inherent_bytes: int = 0
    extra: dict = field(default_factory=dict)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp(layers: int = 8) -> nn.Module:
    """``layers`` x (Linear(D, D) + GELU) and a head: 2 MiB of float32 parameters, so a
    gradient kept per micro-batch would add 2 GiB at k=1,024 (one layer's, 256 MiB).

    Many small tensors rather than a few large ones: glibc's dynamic thresholds keep up to
    twice the largest block freed so far untrimmed at the top of the heap, and whether that
    slack is resident at the step's peak varies from process to process. Measured on ``plain``
    (6 processes per size): rises spread over 3-7 MiB with 1 MiB weights (4 x 512 wide), over
    0.7-1.5 MiB with 256 KiB weights; with a 4 MiB weight, 6 MiB."""
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(D, D), nn.GELU()]
    return nn.Sequential(*body, nn.Linear(D, CLASSES))


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _seeded(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batches(k: int, seed: int, make: Callable[[int, int], Any] = _rows) -> tuple[Any, Any]:
    return make(WARMUP * M, seed + 1000), make(k * M, seed)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)  # state made at the warm-up step


# --- one process -------------------------------------------------------------------------------


def plain(k: int, device: str, rank: int = 0) -> Case:
    """An MLP with ``nn.CrossEntropyLoss``: the step's plain path."""
    model = _mlp().to(device)
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), *_batches(k, rank))


@dataclass
class _Looped:
    num_micro_batches: int


def hand_loop(k: int, device: str, rank: int = 0) -> Case:
    """The flat reference, no mbs_ext: PyTorch's own gradient accumulation over the same
    micro-batches of ``plain``'s model (slice, forward, backward of the weighted loss into
    ``.grad``, one AdamW step). What it shows between k=8 and k=1,024 is the measurement's own
    noise, which the tolerance is set from."""
    model = _mlp().to(device)
    return Case(_accumulating(model, device), *_batches(k, rank))


def _accumulating(model: nn.Module, device: str) -> Callable[[Any], _Looped]:
    """PyTorch's own accumulation loop over micro-batches of :data:`M` rows of ``model`` (slice,
    forward, backward of the weighted loss into ``.grad``, one AdamW step): the references."""
    opt, loss = _opt(model), nn.CrossEntropyLoss()

    def run(batch: tuple[torch.Tensor, torch.Tensor]) -> _Looped:
        x, y = batch
        opt.zero_grad()
        for i in range(0, len(x), M):
            xb, yb = x[i:i + M].to(device), y[i:i + M].to(device)
            (loss(model(xb), yb) * (len(xb) / len(x))).backward()
        opt.step()
        return _Looped(-(-len(x) // M))

    return run


def device_counts(k: int, device: str, rank: int = 0) -> Case:
    """``plain`` with a count read from each micro-batch as a tensor on the model's device (the
    README's token-count form): the step may not read it per micro-batch (one host sync per
    step), so whatever it keeps of each count until then shows here."""
    model = _mlp().to(device)
    opt = _opt(model)

    def count(mb: Any) -> torch.Tensor:
        return (mb[1] >= 0).sum()

    return Case(lambda b: mbs_ext.step(model, opt, b, _ce, micro_batch_size=M, normalize=count), *_batches(k, rank))


def leak(k: int, device: str, rank: int = 0) -> Case:
    """The control: ``plain`` whose loss keeps :data:`LEAK_BYTES` per micro-batch (a per-call
    record appended to a list, as a logging hook might). A correct step under a leaking
    ``loss_fn``: the measurement must see the leak, or it cannot see the step's own."""
    model = _mlp().to(device)
    opt, kept = _opt(model), []

    def leaking(mod: nn.Module, mb: Any) -> torch.Tensor:
        loss = _ce(mod, mb)
        kept.append(torch.full((LEAK_BYTES // 4,), 1.0, device=mb[0].device))  # written: resident
        return loss

    return Case(lambda b: mbs_ext.step(model, opt, b, leaking, micro_batch_size=M), *_batches(k, rank),
                extra={"leak_mib": LEAK_BYTES / MIB})


def _bn_net(layers: int, kind: str = "plain") -> nn.Module:
    """``layers`` x (1x1 Conv2d + BatchNorm2d + ReLU) on D x 2 x 2 inputs, then a head: 256 KiB
    of convolution weight and D channels of statistics per layer (D, not 512: see :func:`_mlp`).
    Channels-last (with :func:`_images`): a 1x1 convolution of 2x2 pixels runs 4x faster so on
    one core (measured at 512 channels: 2.0 vs 0.5 ms forward and backward)."""
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Conv2d(D, D, 1, bias=False), nn.BatchNorm2d(D), nn.ReLU()]
    model = nn.Sequential(*body, nn.Flatten(), nn.Linear(D * 4, CLASSES))
    if kind == "across_ranks":
        model = mbs_ext.convert_batchnorm(model, across_ranks=True)
    elif kind == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(memory_format=torch.channels_last)


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _seeded(seed)
    x = torch.randn(n, D, 2, 2, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def batchnorm(k: int, device: str, rank: int = 0) -> Case:
    """Plain ``nn.BatchNorm2d`` in training: the step defers its running statistics and commits
    them once, merged over every micro-batch (docs/batchnorm.md)."""
    model = _bn_net(12).to(device)
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), *_batches(k, rank, _images))


VOCAB, WIDTH = D, 32  # tokens: vocabulary, padded row width


class _TinyLM(nn.Module):
    """Embedding + ``layers`` x (Linear + tanh) + Linear to the vocabulary, all D wide: 2.3 MiB."""

    def __init__(self, layers: int = 7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.body = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(D, D), nn.Tanh())))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.emb(ids)))


def _token_rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` rows right-padded to :data:`WIDTH`, lengths in (2/3 WIDTH, WIDTH]: a budget of two
    full rows holds two rows of any of them, never three, so ``n`` rows make about ``n / 2``
    micro-batches; labels -100 on padding."""
    g = _seeded(seed)
    ids = torch.randint(0, VOCAB, (n, WIDTH), generator=g)
    lengths = torch.randint(2 * WIDTH // 3 + 1, WIDTH + 1, (n, 1), generator=g)
    mask = (torch.arange(WIDTH) < lengths).long()
    labels = torch.where(mask.bool(), torch.roll(ids, -1, 1), -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def _lm_loss(model: nn.Module, mb: dict) -> torch.Tensor:
    logits = model(mb["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)


def tokens(k: int, device: str, rank: int = 0) -> Case:
    """A token budget (``micro_batch_tokens``, docs/tokens.md) over padded rows, counted by labels."""
    model = _TinyLM().to(device)
    opt = _opt(model)

    def count(mb: dict) -> torch.Tensor:
        return (mb["labels"] != -100).sum()

    return Case(lambda b: mbs_ext.step(model, opt, b, _lm_loss, micro_batch_tokens=M * WIDTH, normalize=count),
                *_batches(k, rank, _token_rows))


def hand_tokens(k: int, device: str, rank: int = 0) -> Case:
    """``tokens``' reference, no mbs_ext: PyTorch's own accumulation loop over the micro-batches a
    two-row token budget makes of these rows (sorted longest first, two at a time, each pair
    trimmed to its longer row: with every row longer than two thirds of the width, no budget of
    two full rows holds three). Its micro-batches change shape from one to the next (widths
    from 22 to 32), and glibc's heap answers varying shapes by holding more: this loop alone
    rises about 2.4 MiB more at k=1,024 than at k=8. ``tokens`` is measured against it."""
    model = _TinyLM().to(device)
    opt = _opt(model)

    def run(batch: dict) -> _Looped:
        lengths = batch["attention_mask"].sum(1)
        order = torch.argsort(lengths, descending=True, stable=True)
        total = int((batch["labels"] != -100).sum())
        opt.zero_grad()
        for i in range(0, len(order), M):
            rows = order[i:i + M]
            width = int(lengths[rows[0]])
            ids, labels = (batch[key][:, :width].index_select(0, rows).to(device) for key in ("input_ids", "labels"))
            logits = model(ids)
            (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
             / total).backward()
        opt.step()
        return _Looped(-(-len(order) // M))

    return Case(run, *_batches(k, rank, _token_rows))


EMBED = 8  # cached_loss: encoding width, small so that every row's encodings stay well under 1 MiB
CHUNK = 64  # cached_loss: rows of the in-batch logits computed at once


class _Towers(nn.Module):
    """Two towers (4 x (Linear(D, D) + GELU) + Linear(D, EMBED) each, 2 MiB of parameters in
    all) and a learned temperature."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.doc = (
            nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(D, D), nn.GELU())), nn.Linear(D, EMBED))
            for _ in range(2))
        self.log_temperature = nn.Parameter(torch.tensor(-2.0))


def _pairs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = _seeded(seed)
    q = torch.randn(n, D, generator=g)
    return {"q": q, "d": q + 0.1 * torch.randn(n, D, generator=g)}


def _encode(model: _Towers, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model.query(mb["q"]), model.doc(mb["d"])


class _TiledNCE(torch.autograd.Function):
    """``sum_i logsumexp_j(s a_i.b_j) - s a_i.b_i`` (one direction of InfoNCE over in-batch
    negatives, rows of ``a`` against rows of ``b``, ``s`` the scale) and its gradient, both taken
    in :data:`CHUNK` x :data:`CHUNK` tiles of the logits: no temporary is larger than a tile, and
    tiles are all one size, so the heap reuses them. Autograd's own graph of the same tiles
    (checkpointed per row chunk) left 17-20 MiB of glibc heap resident at 2,048 rows, loss alone."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        lse = torch.cat([_lse(rows, b, scale) for _, rows in _tiles(a)])
        ctx.save_for_backward(a, b, scale, lse)
        return lse.sum() - (a * b).sum() * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, scale, lse = ctx.saved_tensors
        ga, gb, gs = -scale * b, -scale * a, -(a * b).sum()
        for i, rows in _tiles(a):
            for j, cols in _tiles(b):
                dots = rows @ cols.t()
                p = (dots * scale - lse[i:i + len(rows), None]).exp()
                ga[i:i + len(rows)] += scale * p @ cols
                gb[j:j + len(cols)] += scale * p.t() @ rows
                gs += (p * dots).sum()
        return grad * ga, grad * gb, grad * gs


def _tiles(x: torch.Tensor) -> Any:
    return ((i, x[i:i + CHUNK]) for i in range(0, len(x), CHUNK))


def _lse(rows: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp over every row of ``b``, merged a tile at a time."""
    out = None
    for _, cols in _tiles(b):
        part = (rows @ cols.t() * scale).logsumexp(1)
        out = part if out is None else torch.logaddexp(out, part)
    return out


def _info_nce(model: _Towers, enc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Symmetric InfoNCE over in-batch negatives in bounded memory (:class:`_TiledNCE`): what grows
    with the mini-batch is the encodings alone, as docs/coupled-losses.md says of such a loss."""
    q, d = (F.normalize(t, dim=1) for t in enc)
    scale = model.log_temperature.neg().exp()
    return (_TiledNCE.apply(q, d, scale) + _TiledNCE.apply(d, q, scale)) / (2 * len(q))


def cached_loss(k: int, device: str, rank: int = 0) -> Case:
    """``mbs_ext.CachedLoss`` (gradient caching) with a contrastive loss. Every row's encodings
    are held by nature: ``inherent_bytes`` counts them four times (pass 1's outputs and their
    concatenation, the leaves of pass 2 and their gradients), both towers."""
    model = _Towers().to(device)
    opt = _opt(model)
    loss = mbs_ext.CachedLoss(_encode, _info_nce)
    warm, batch = _batches(k, rank, _pairs)
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), warm, batch,
                inherent_bytes=4 * 2 * k * M * EMBED * 4)


def accumulate(k: int, device: str, rank: int = 0) -> Case:
    """``mbs_ext.accumulate``: the gradient into ``.grad``, no optimizer step (a Trainer's)."""
    model = _mlp().to(device)
    loss = nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.accumulate(model, b, loss, micro_batch_size=M), *_batches(k, rank))


# --- two gloo ranks ----------------------------------------------------------------------------


def ddp(k: int, device: str, rank: int = 0) -> Case:
    """``plain`` under DistributedDataParallel: gradients reduced once per step."""
    model = nn.parallel.DistributedDataParallel(_mlp().to(device))
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), *_batches(k, rank))


# Two layers, not eight: FSDP2's gather and reduce buffers hold every parameter of the root at
# once, and their reuse moves the heap's top by about their size from process to process. At 8
# layers (2 MiB) FSDP2's own loop grew +9.9 to +13.5 MiB and this case +13.7 to +18.7 (three
# processes each); at 2 layers +5.3 to +5.5 and +6.0 to +6.7 (those with PyTorch's flight
# recorder on: run_case turns it off; then +0.9 to +3.7 and +1.7 to +2.0).
FSDP_LAYERS = 2


def fsdp2(k: int, device: str, rank: int = 0) -> Case:
    """``plain``'s MLP, :data:`FSDP_LAYERS` deep, sharded by FSDP2, its default
    ``fsdp_accumulate="sharded"``: a reduce-scatter per micro-batch into the sharded sum. One
    ``fully_shard`` at the root (half the parameters on each rank): one all-gather and one
    reduce-scatter per micro-batch. Sharding every layer as well runs those per layer: on two
    ranks sharing two cores a k=1,024 step of four such layers took 37 s, against 16 s for this
    model sharded once. Measured against ``hand_fsdp2`` (FSDP2's own loop), which is not flat."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp(FSDP_LAYERS).to(device)
    fully_shard(model, mesh=init_device_mesh(torch.device(device).type, (dist.get_world_size(),)))
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), *_batches(k, rank))


def hand_fsdp2(k: int, device: str, rank: int = 0) -> Case:
    """``fsdp2``'s reference, no mbs_ext: the same sharded model under FSDP2's own gradient
    accumulation (each micro-batch's backward reduce-scatters into the sharded gradient, FSDP2's
    default), one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp(FSDP_LAYERS).to(device)
    fully_shard(model, mesh=init_device_mesh(torch.device(device).type, (dist.get_world_size(),)))
    return Case(_accumulating(model, device), *_batches(k, rank))


# Two-rank BatchNorm cases: each layer runs two collectives per micro-batch, about 3.5 ms each
# on two ranks sharing two cores (4 layers: 28 ms a micro-batch, 2 layers 13 ms).
RANK_BN_LAYERS = 2


def batchnorm_across_ranks(k: int, device: str, rank: int = 0) -> Case:
    """``convert_batchnorm(model, across_ranks=True)`` under DDP: each micro-batch's statistics
    over both ranks' rows of it (two all-reduces per layer and micro-batch)."""
    model = nn.parallel.DistributedDataParallel(_bn_net(RANK_BN_LAYERS, kind="across_ranks").to(device))
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M), *_batches(k, rank, _images))


def syncbatchnorm(k: int, device: str, rank: int = 0) -> Case:
    """``nn.SyncBatchNorm`` (``convert_sync_batchnorm``): the step gives it the across-ranks
    semantics. Replicated by hand (``process_group=``, as tests/test_batchnorm_ranks.py does):
    DistributedDataParallel refuses SyncBatchNorm in a CPU module; on CUDA it wraps the model."""
    model = _bn_net(RANK_BN_LAYERS, kind="sync").to(device)
    kw: dict = {"process_group": dist.group.WORLD}
    if torch.device(device).type == "cuda":
        model, kw = nn.parallel.DistributedDataParallel(model), {}
    opt, loss = _opt(model), nn.CrossEntropyLoss()
    return Case(lambda b: mbs_ext.step(model, opt, b, loss, micro_batch_size=M, **kw), *_batches(k, rank, _images))


SINGLE = {f.__name__: f for f in (plain, device_counts, batchnorm, tokens, cached_loss, accumulate, hand_loop,
                                   hand_tokens, leak)}
RANKED = {f.__name__: f for f in (ddp, fsdp2, hand_fsdp2, batchnorm_across_ranks, syncbatchnorm)}


# --- measuring ---------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(case: Case, device: str, sizes: list[int], barrier: Callable[[], None] = lambda: None) -> list[dict]:
    """Warm up, then for each of ``sizes`` (micro-batches; the largest is the size ``case`` was built
    for) the peak one step of that many first micro-batches of ``case.batch`` adds over what was
    resident before it, in turn (one row each), after the one warm-up."""
    t0 = time.perf_counter()
    case.run(case.warm)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    whole = max(sizes)
    return [{**_peak_of(case, _first(case.batch, k, whole), k / whole, device, barrier), "warmup_s": warmup_s}
            for k in sizes]


def _first(batch: Any, k: int, whole: int) -> Any:
    """The first ``k`` micro-batches of ``batch`` (``whole`` of them): the batch itself at its own size."""
    return batch if k == whole else tree_map(lambda t: t[: k * M], batch)


def _peak_of(case: Case, batch: Any, share: float, device: str, barrier: Callable[[], None]) -> dict:
    """The peak one step of ``batch`` (``share`` of ``case.batch``'s rows) adds over what is live
    just before it."""
    gc.collect()
    malloc_trim()  # freed heap pages of the build and warm-up leave: the base is what is live
    barrier()  # ranks start together (the step's collectives would make one wait on the other)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = proc_status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    t0 = time.perf_counter()
    result = case.run(batch)
    _sync(device)
    step_s = time.perf_counter() - t0
    if cuda:
        peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    else:
        status = proc_status()
        peak, after = status["VmHWM"], status["VmRSS"]
    return {"micro_batches": result.num_micro_batches, "rise_mib": (peak - base) / MIB,
            "kept_mib": (after - base) / MIB, "base_mib": base / MIB,
            "inherent_mib": case.inherent_bytes * share / MIB,
            "step_s": step_s, "cpu_s": time.process_time(), **case.extra}


def _quiet() -> None:
    warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)  # per-micro-batch statistics: known


def _rank(rank: int, name: str, ks: list[int], device: str) -> list[dict]:
    """One rank of a two-rank case (run by ``ddp_harness.run_world``, which joined the gloo group)."""
    _quiet()
    case = RANKED[name](max(ks), device, rank)
    return measure(case, device, ks, barrier=dist.barrier)


def run_case(name: str, ks: list[int], device: str) -> list[dict]:
    """The JSON rows of ``name``, one for each size in ``ks`` (micro-batches), in turn in one process."""
    torch.set_num_threads(1)
    _quiet()
    if name in SINGLE:
        rows = measure(SINGLE[name](max(ks), device), device, ks)
        return [{"case": name, "k": k, "device": device, **row} for k, row in zip(ks, rows)]
    sys.path.insert(0, str(ROOT / "tests"))
    from ddp_harness import run_world

    # PyTorch's flight recorder keeps an entry (about 1 KiB, with its Python stack) for each of the
    # last 2,000 collectives: bounded, but not flat over the first 2,000, so that a step of 1,024
    # micro-batches would show it (+1.8 MiB of live heap in FSDP2's own loop, +1 MiB under
    # two-rank BatchNorm; none with it off). The ranks run without it, unless it is asked for.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")

    ranks = run_world(_rank, name, ks, device, timeout=WORLD_TIMEOUT_S)
    spent = time.process_time() + sum(rows[-1]["cpu_s"] for rows in ranks)
    out = []
    for k, at_k in zip(ks, zip(*ranks)):
        worst = max(at_k, key=lambda r: r["rise_mib"])
        out.append({"case": name, "k": k, "device": device, **worst,
                    "micro_batches": [r["micro_batches"] for r in at_k],
                    "rank_rises_mib": [r["rise_mib"] for r in at_k],
                    "step_s": max(r["step_s"] for r in at_k), "cpu_s": spent})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, choices=[*SINGLE, *RANKED])
    parser.add_argument("--k", required=True, type=lambda v: [int(k) for k in v.split(",")],
                        help="micro-batches of the measured step; several (8,1024) measure a step of each in turn in "
                             "one process, after one warm-up, a JSON line each")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    for row in run_case(args.case, args.k, args.device):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
