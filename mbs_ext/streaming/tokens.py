"""How a step's rows are split into micro-batches: by rows (:class:`Rows`), or by tokens (:class:`Tokens`).

A language-model batch is rows of very different lengths padded to the longest. Cut by
rows, every micro-batch carries the whole batch's padding: its compute and memory follow
the padded width, not the tokens. With ``micro_batch_tokens=T`` the rows are grouped by
length (longest first), each micro-batch holds at most ``T`` tokens counting padding
(rows x width) and is trimmed along the sequence dimension to its longest row.

The step stays exact: its rows are summed (their order does not matter), counts are taken
per micro-batch (:mod:`~mbs_ext.counts.sources`), and the trimmed columns are trailing padding,
which a right-padded model with an attention mask never lets a real token see. What would
break that is refused before anything changes: left padding or holes in the mask (positions
would move), labels that are not ignored at padding positions (they would drop out of the
loss), a row longer than ``T``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbs_ext.model.options import StepOptions
from mbs_ext.streaming.batch import BatchInfo
from mbs_ext.streaming.ring import StreamRing, split_sizes

MASK_KEY = "attention_mask"
LABELS_KEY = "labels"
IGNORE_INDEX = -100  # what transformers' losses (and torch's cross entropy by default) skip


@dataclass(frozen=True)
class TokenPlan:
    """Micro-batches of rows grouped by length: ``order`` (the rows, longest first: of the batch,
    or of the dataset with ``indices``), ``sizes`` (rows per micro-batch), ``widths`` (each one's
    trimmed width) and ``lengths`` (the real tokens of each row, in ``order``)."""

    order: torch.Tensor
    sizes: list[int]
    widths: list[int]
    lengths: torch.Tensor

    @property
    def num_micro_batches(self) -> int:
        return len(self.sizes)

    @property
    def padding(self) -> float:
        """The fraction of streamed token positions that are padding."""
        streamed = sum(s * w for s, w in zip(self.sizes, self.widths))
        return 1.0 - float(self.lengths.sum()) / streamed if streamed else 0.0


def plan_tokens(lengths: torch.Tensor, micro_batch_tokens: int, micro_batch_size: int | None = None,
                rows: torch.Tensor | None = None) -> TokenPlan:
    """Group rows of ``lengths`` real tokens into micro-batches of at most ``micro_batch_tokens``
    tokens counting padding (and at most ``micro_batch_size`` rows).

    Rows are sorted longest first; a micro-batch takes consecutive sorted rows and is as wide
    as its first. Where to cut is chosen to stream the fewest token positions, each
    micro-batch charged :data:`OVERHEAD` of the budget on top (docs/tokens.md): packing
    greedily would put a few long rows and many short ones in one wide micro-batch, all of
    them padded to the longest; cutting at every change of length would launch many small
    micro-batches. The longest micro-batch comes first, so the step's peak memory shows at
    once. ``rows`` names the rows (default: ``0..N-1``), e.g. a step's ``indices``.
    """
    lengths = torch.as_tensor(lengths).to("cpu", torch.int64).reshape(-1)
    n = lengths.numel()
    if n == 0:
        raise ValueError("lengths is empty: no rows to plan")
    longest = int(lengths.max())
    if longest > micro_batch_tokens:
        row = int(lengths.argmax())
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens}: row {row} has {longest} tokens, more than one "
                         f"micro-batch may hold; raise micro_batch_tokens to at least {longest} or truncate the rows")
    perm = torch.argsort(lengths, descending=True, stable=True)
    ordered = lengths[perm]
    sizes, widths = _cuts(ordered.clamp(min=1), micro_batch_tokens, n if micro_batch_size is None
                          else int(micro_batch_size))
    order = perm if rows is None else rows.index_select(0, perm)
    return TokenPlan(order, sizes, widths, ordered)


OVERHEAD = 1 / 8  # of the budget: what one more micro-batch is charged, in token positions


def _cuts(ordered: torch.Tensor, budget: int, cap: int) -> tuple[list[int], list[int]]:
    """Sizes and widths of consecutive groups of ``ordered`` (lengths, longest first, >= 1) that
    minimize the streamed positions (rows x width) plus ``OVERHEAD * budget`` per group: a
    shortest path over the row boundaries, one vectorized relaxation per group start.

    The relaxation writes into buffers made once: a tensor made per row (as ``torch.where``
    would) left about 1.4 KiB of heap resident per row of the batch under glibc's defaults (2.4
    MiB at 2,048 rows, measured by the OS), memory the step then held while it streamed."""
    n = len(ordered)
    widths_of = ordered.tolist()
    best = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    start = torch.zeros(n + 1, dtype=torch.int64)
    charge = OVERHEAD * budget
    most = min(budget // min(widths_of), cap, n)  # the widest relaxation: from the shortest row
    steps = torch.arange(1, most + 1, dtype=torch.float64)
    reach, better = torch.empty(most, dtype=torch.float64), torch.empty(most, dtype=torch.bool)
    for i in range(n):
        w = widths_of[i]
        k = min(budget // w, cap, n - i)
        here, won, ahead = reach[:k], better[:k], best[i + 1:i + k + 1]
        torch.mul(steps[:k], w, out=here).add_(float(best[i]) + charge)
        torch.lt(here, ahead, out=won)
        torch.minimum(ahead, here, out=ahead)
        start[i + 1:i + k + 1].masked_fill_(won, i)
    sizes, widths, j = [], [], n
    starts = start.tolist()
    while j > 0:
        i = starts[j]
        sizes.append(j - i)
        widths.append(widths_of[i])
        j = i
    return sizes[::-1], widths[::-1]


class Rows:
    """The row split: balanced sizes of at most ``m`` rows, streamed by the ring."""

    def __init__(self, info: BatchInfo, m: int) -> None:
        self.info, self.m = info, m
        self.sizes = split_sizes(info.rows, m)
        self.indexed = info.indices is not None  # rows are positions in ``indices`` (messages say so)

    def stream(self, ring: StreamRing, batch: Any, device: torch.device) -> Any:
        # A CPU model reads row ranges of the host batch in place: nothing to stage.
        return ring.stream(batch, self.m, indices=self.info.indices, copy=device.type != "cpu")

    def stats(self, ring: StreamRing) -> dict:
        return ring.stats()

    def describe(self, start: int, stop: int) -> str:
        """The rows of the micro-batch at positions ``[start, stop)``, for error notes."""
        return f"rows [{start}, {stop}) of {'indices' if self.indexed else 'the mini-batch'}"


class Tokens:
    """The token split: rows grouped by length, each micro-batch trimmed to its widest row."""

    def __init__(self, batch: Any, info: BatchInfo, options: StepOptions, m: int) -> None:
        lengths, width = row_lengths(batch, info, options.token_lengths)
        self.indexed = info.indices is not None  # rows are numbered in the dataset (messages say so)
        self.plan = plan_tokens(lengths, options.micro_batch_tokens, m, rows=info.indices)
        self.width = width
        # Counts and the world read the rows at ``indices``: the grouped order (of the dataset's rows).
        self.info = info._replace(indices=self.plan.order)
        self.sizes = self.plan.sizes
        self._stats: dict = {}

    def stream(self, ring: StreamRing, batch: Any, device: torch.device) -> TokenStream:
        ring.close()  # the ring's own stream (if any) does not run beside this one
        self._stats = {"stage_s": 0.0, "wait_s": 0.0, "micro_batches": 0, "bytes": 0,
                       "planned_micro_batches": len(self.sizes), "padding": self.plan.padding}
        return TokenStream(batch, self.plan, self.width, device, self._stats)

    def stats(self, ring: StreamRing) -> dict:
        return dict(self._stats)

    def heaviest(self, batch: Any, device: torch.device) -> tuple[Any, int]:
        """The micro-batch of the most token positions (rows x width), trimmed, on ``device``, and
        its rows: what out-of-memory back-off probes at this budget (:mod:`mbs_ext.memory.axis`)."""
        plan = self.plan
        k = max(range(len(plan.sizes)), key=lambda j: plan.sizes[j] * plan.widths[j])
        start, stop = sum(plan.sizes[:k]), sum(plan.sizes[: k + 1])
        one = _one_micro_batch(batch, plan.order[start:stop], plan.lengths[start:stop], plan.widths[k], self.width,
                               device)
        return one, plan.sizes[k]

    def describe(self, start: int, stop: int, shown: int = 8) -> str:
        """The rows of the micro-batch at positions ``[start, stop)`` of the grouped order, by their
        numbers in the mini-batch (or, with ``indices``, in the dataset), for error notes."""
        rows = self.plan.order[start:stop].tolist()
        listed = ", ".join(map(str, rows[:shown])) + (f", ... ({len(rows)} rows)" if len(rows) > shown else "")
        return f"rows {listed} of {'the dataset' if self.indexed else 'the mini-batch'}, grouped by length"


def longest_first(batch: Any, info: BatchInfo, token_lengths: Any) -> tuple[Any, int]:
    """The step's rows (at ``indices`` where given) longest first, trimmed to the longest, on the
    host, and that width: what ``micro_batch_tokens="auto"`` plans rows of (the first rows of
    any micro-batch the plan makes are at most this wide)."""
    lengths, width = row_lengths(batch, info, token_lengths)
    order = torch.argsort(lengths, descending=True, stable=True)
    rows = order if info.indices is None else info.indices.index_select(0, order)
    longest = max(1, int(lengths.max()))
    return _one_micro_batch(batch, rows, lengths[order], longest, width, torch.device("cpu")), longest


def _one_micro_batch(batch: Any, rows: torch.Tensor, lengths: torch.Tensor, trim: int, width: int,
                     device: torch.device) -> Any:
    """The batch's ``rows`` (of ``lengths`` tokens) as one micro-batch, gathered and trimmed to
    ``trim`` as :class:`TokenStream` streams them (sequence leaves: dim 1 is ``width``)."""
    plan = TokenPlan(rows, [len(rows)], [trim], lengths)
    return next(TokenStream(batch, plan, width, device, {"stage_s": 0.0, "micro_batches": 0, "bytes": 0}))


def split(batch: Any, info: BatchInfo, options: StepOptions, m: int) -> Rows | Tokens:
    """How this step's rows are split: by tokens where ``micro_batch_tokens`` is set."""
    return Rows(info, m) if options.micro_batch_tokens is None else Tokens(batch, info, options, m)


ROWS_AT_ONCE = 256  # rows of a mask or labels read at once: a check's temporaries stay this size


def row_lengths(batch: Any, info: BatchInfo, token_lengths: Any) -> tuple[torch.Tensor, int]:
    """The real tokens of each of the step's rows (at ``indices`` where given) and the padded width.

    Masks and labels are read :data:`ROWS_AT_ONCE` rows at a time: a comparison over every row
    at once made temporaries of the whole batch's shape, heap that stayed resident beside the
    micro-batches streamed after it (docs/known-issues.md, memory that grows)."""
    keyed = _keyed_leaves(batch)
    if callable(token_lengths):
        lengths = torch.as_tensor(token_lengths(batch))
        width = max((t.shape[1] for _, t in keyed if t.dim() >= 2), default=0)
        if lengths.dim() != 1 or lengths.numel() != _rows_of(batch) or lengths.is_floating_point():
            raise ValueError("token_lengths: the callable must return a 1-d integer tensor with one length per row "
                             f"of the batch, got shape {tuple(lengths.shape)} and dtype {lengths.dtype}")
        lengths = lengths.to("cpu", torch.int64)
        if info.indices is not None:
            lengths = lengths.index_select(0, info.indices)
        if int(lengths.max()) > width or int(lengths.min()) < 0:
            raise ValueError(f"token_lengths: lengths must lie in [0, {width}] (the padded width of the batch)")
    else:
        key = MASK_KEY if token_lengths is None else token_lengths
        mask = _find(keyed, key)
        if mask is None or mask.dim() != 2:
            raise ValueError(f"micro_batch_tokens: the batch has no 2-d {key!r} leaf (a dict key) to read row "
                             "lengths from; name the mask with token_lengths='key', or pass token_lengths="
                             "a callable(batch) returning each row's length")
        width = mask.shape[1]
        lengths = torch.cat([_right_padded(_block(mask, info, a), key) for a in range(0, info.rows, ROWS_AT_ONCE)])
    labels = _find(keyed, LABELS_KEY)
    if labels is not None and labels.dim() == 2 and labels.shape[1] == width and not labels.is_floating_point():
        for a in range(0, info.rows, ROWS_AT_ONCE):
            _check_labels(_block(labels, info, a), lengths[a:a + ROWS_AT_ONCE], width)
    return lengths, width


def _block(leaf: torch.Tensor, info: BatchInfo, first: int) -> torch.Tensor:
    """:data:`ROWS_AT_ONCE` of the step's rows of ``leaf`` from ``first`` (at ``indices`` where given), on the host."""
    if info.indices is None:
        return leaf[first:first + ROWS_AT_ONCE].to("cpu")
    return leaf.index_select(0, info.indices[first:first + ROWS_AT_ONCE].to(leaf.device)).to("cpu")


def _right_padded(mask: torch.Tensor, key: str) -> torch.Tensor:
    """Each row's length, where every row's mask is ones then zeros; else refused."""
    real = mask != 0
    lengths = real.sum(1)
    positions = torch.arange(mask.shape[1])
    if torch.equal(real, positions < lengths[:, None]):
        return lengths
    left = torch.equal(real, positions >= (mask.shape[1] - lengths)[:, None])
    what = "left-padded (real tokens at the end)" if left else "not padded at the end only (zeros between ones)"
    raise ValueError(
        f"micro_batch_tokens: the rows of {key!r} are {what}; trimming keeps the leading columns, which is "
        "exact for right padding only (positions would move otherwise). Pad on the right "
        "(tokenizer.padding_side='right'), or split by rows with micro_batch_size alone"
    )


def _check_labels(labels: torch.Tensor, lengths: torch.Tensor, width: int) -> None:
    """Labels counted at padding positions would drop out of the loss when trimmed: refused."""
    padding = torch.arange(width) >= lengths[:, None]
    if bool((labels[padding] != IGNORE_INDEX).any()):
        raise ValueError(
            f"micro_batch_tokens: {LABELS_KEY!r} holds targets at padding positions, which the full batch's loss "
            f"counts and trimmed micro-batches would not; set them to {IGNORE_INDEX} (ignored) where the "
            "attention mask is 0"
        )


def _keyed_leaves(batch: Any) -> list[tuple[Any, torch.Tensor]]:
    """(last dict key or None, tensor) for every tensor leaf."""
    leaves, _ = pytree.tree_flatten_with_path(batch)
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            last = path[-1] if path else None
            out.append((getattr(last, "key", None), leaf))
    return out


def _find(keyed: list[tuple[Any, torch.Tensor]], key: str) -> torch.Tensor | None:
    return next((t for k, t in keyed if k == key), None)


def _rows_of(batch: Any) -> int:
    return next(t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)).shape[0]


class TokenStream:
    """The micro-batches of a :class:`TokenPlan`: rows gathered in the plan's order, every sequence
    leaf (a tensor whose dim 1 is the padded width) trimmed to the micro-batch's width before
    the gather, so only the trimmed bytes are copied, then moved to ``device``. Same face as the
    ring's iterator: ``index``, ``rows`` (positions in the plan's order), ``close()``."""

    def __init__(self, batch: Any, plan: TokenPlan, width: int, device: torch.device, stats: dict) -> None:
        flat, self._spec = pytree.tree_flatten(batch)
        self._flat = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
        where = next(x.device for x in self._flat if isinstance(x, torch.Tensor))
        self._order = plan.order.to(where)
        self._seq = [isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == width for x in self._flat]
        self._plan, self._device, self._stats = plan, device, stats
        self._starts = [0]
        for size in plan.sizes:
            self._starts.append(self._starts[-1] + size)
        self.index, self.rows = -1, (0, 0)

    def __iter__(self) -> TokenStream:
        return self

    def __len__(self) -> int:
        return len(self._plan.sizes)

    def __next__(self) -> Any:
        j = self.index + 1
        if j >= len(self._plan.sizes):
            raise StopIteration
        t0 = time.perf_counter()
        start, stop, w = self._starts[j], self._starts[j + 1], self._plan.widths[j]
        rows = self._order[start:stop]
        out = []
        for x, seq in zip(self._flat, self._seq):
            if isinstance(x, torch.Tensor):
                x = (x[:, :w] if seq else x).index_select(0, rows).to(self._device, non_blocking=True)
                if seq:
                    _maybe_dynamic(x)
                self._stats["bytes"] += x.nbytes
            out.append(x)
        self.index, self.rows = j, (start, stop)
        self._stats["micro_batches"] += 1
        self._stats["stage_s"] += time.perf_counter() - t0
        return pytree.tree_unflatten(out, self._spec)

    def close(self) -> None:
        self.index = len(self._plan.sizes)


def _maybe_dynamic(x: torch.Tensor) -> None:
    """Rows and width change from micro-batch to micro-batch: a compiled model traces them as
    symbols once instead of compiling a graph per shape."""
    dynamo = sys.modules.get("torch._dynamo")  # imported where something is compiled; not imported here
    mark = getattr(dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(x, 0)
        mark(x, 1)
