"""Where gradients add up (the step's gradient sink): in ``.grad`` through autograd, or in float32 buffers.

Autograd accumulates into ``.grad`` by itself when the parameters' dtype is precise
enough; the weight of a micro-batch is then folded into its loss. For bf16/fp16
parameters a bf16 ``.grad`` would lose the small contributions of later micro-batches,
so each micro-batch's gradient is added into a flat float32 buffer by the fused
``scale_accumulate_`` op (which also flags non-finite gradients on the device, with no
extra pass and no host sync), and the sum is cast into ``.grad`` once at the end.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mbs_ext.ops import noise_tap, scale_accumulate_, sum_squares_

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Each parameter's view into a flat buffer starts on this boundary. Gradients are
# separate allocations (aligned far beyond it), so accumulator and gradient then
# agree modulo 16 bytes and both kernels take their 16-byte vector path over the
# whole parameter; one odd-sized parameter would otherwise shift every view after it
# off that path.
VIEW_ALIGN_BYTES = 16


def buffer_layout(numels: list[int], element_size: int) -> tuple[list[int], int]:
    """Offsets (in elements) of views of ``numels`` elements in a flat buffer, and its length."""
    step = max(1, VIEW_ALIGN_BYTES // element_size)
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end += -(-n // step) * step
    return offsets, end


def accumulation_dtype(requested: torch.dtype | None, params: list[nn.Parameter],
                       buffered: bool = False) -> torch.dtype | None:
    """dtype of separate accumulation buffers, or None when autograd accumulates in ``.grad``.
    ``buffered``: buffers in any case (the noise scale reads each micro-batch's gradient on its
    way into them): float32, float64 where a parameter is, unless a dtype is requested."""
    if buffered:
        return requested or (torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32)
    if requested is None:
        return torch.float32 if any(p.dtype in LOW_PRECISION for p in params) else None
    return None if all(p.dtype == requested for p in params) else requested


class NoiseSums:
    """The noise scale's per-micro-batch sums: each micro-batch's sum of squares of its gradient
    and the weight it was added with, weighed and summed once, at the end (:meth:`sums`). The
    sums of squares are the elements of float64 vectors of :data:`BLOCK` on ``device``, each
    micro-batch's a 0-dim view of one (:meth:`slot`): no zeroed tensor made per micro-batch, and
    views made only as they are needed (each costs microseconds on the CPU, more right after a
    backward has pushed the interpreter's memory out of the caches: 64 made at once took 0.16 ms).
    ``folded``: the weights rode the losses, so each sum of squares is of a gradient already
    weighed by ``w_j`` (``w_j^2 |g_j|^2``). ``host``: where the sums of squares are host numbers
    kept elsewhere (the CPU's tap, :class:`TakenGrads`), what reads them, one per micro-batch in
    order; :meth:`slot` is then never called."""

    BLOCK = 64  # elements of a vector of sums

    def __init__(self, device: torch.device, folded: bool = False,
                 host: Callable[[], list[float]] | None = None) -> None:
        self.device = device
        self.folded = folded
        self.host = host
        self.blocks: list[torch.Tensor] = []
        self.slots: list[torch.Tensor] = []
        self.weights: list[float | torch.Tensor] = []
        self.cached: tuple[float | torch.Tensor, float | torch.Tensor] | None = None

    def slot(self) -> torch.Tensor:
        """A zeroed 0-dim float64 for the next micro-batch's sum of squares (then :meth:`add`)."""
        m = len(self.weights)
        if m == len(self.slots):
            if m == len(self.blocks) * self.BLOCK:
                self.blocks.append(torch.zeros(self.BLOCK, dtype=torch.float64, device=self.device))
            self.slots.append(self.blocks[-1].select(0, m % self.BLOCK))
        return self.slots[m]

    def add(self, weight: float | torch.Tensor) -> None:
        """The weight of the micro-batch whose squares went into the last :meth:`slot`."""
        self.cached = None
        self.weights.append(weight)

    def sums(self) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """``sum_j w_j |g_j|^2`` over the micro-batches, and how many came with a weight other than
        0 (a count of 0, or a padding micro-batch, adds nothing to either sum and must not count
        in ``m`` either)."""
        if self.cached is None:
            self.cached = self._sums()
        return self.cached

    def _sums(self) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        weights = self.weights
        if not weights:
            return 0.0, 0.0
        if not any(isinstance(w, torch.Tensor) for w in weights):
            count = float(sum(w != 0 for w in weights))
            # Folded: w_j^2 |g_j|^2 / w_j (a weight of 0 added nothing: its factor is 0, not 1/0).
            factors = [(1.0 / w if w else 0.0) if self.folded else float(w) for w in weights]
            if self.host is not None or self.device.type == "cpu":  # host numbers: summed here, in order
                values = self.host() if self.host is not None else [v for block in self.blocks for v in block.tolist()]
                return math.fsum(f * v for f, v in zip(factors, values)), count
            # On a device the host factors ride a fused multiply's launch (a tensor of them would be
            # a copy from pageable memory, which waits for the device).
            return torch.stack(torch._foreach_mul(list(self.slots[: len(weights)]), factors)).sum(), count
        if self.host is not None:
            squares = torch.tensor(self.host()[: len(weights)], dtype=torch.float64, device=self.device)
        else:
            squares = (self.blocks[0] if len(self.blocks) == 1 else torch.cat(self.blocks))[: len(weights)]
        stacked = torch.stack([w.to(self.device, torch.float64) if isinstance(w, torch.Tensor)
                               else torch.full((), float(w), dtype=torch.float64, device=self.device)
                               for w in weights])
        weighed = torch.where(stacked != 0, squares / stacked, 0.0) if self.folded else squares * stacked
        return weighed.sum(), (stacked != 0).sum().to(torch.float64)


class TakenGrads:
    """Sums that are each parameter's ``.grad`` itself, as autograd's are, with each micro-batch's
    squares taken on the way in.

    The noise scale reads each micro-batch's gradient on its way into the sums, which takes the
    op rather than autograd's own accumulation. Flat buffers for that (:class:`GradBuffers`) cost
    a step two passes over memory more than ``.grad`` does: the buffer zeroed, and the first
    micro-batch's gradient added into it. Here a tap before autograd's accumulation
    (:func:`~mbs_ext.ops.noise_tap`) lets a parameter's first gradient become its ``.grad`` as it
    is and adds each later one into it through the op with its squares, at scale 1 (the micro-
    batches' weights ride their losses, as with ``.grad``, and :class:`NoiseSums` divides them
    out of the squares), inside the backward: the gradient read while still in the caches, its
    memory free for the next parameter's, no Python per parameter. The first gradient's own
    squares come with its next addition, or, for a parameter no later micro-batch reaches, from
    one read at the end: no pass of their own. For one process on the CPU, parameters of the
    accumulation dtype (nothing to cast, no collective over flat buffers): :func:`takes_grads`.
    """

    folds = True  # the caller weighs each micro-batch's loss; the tap adds at scale 1
    casts = False  # .grad is the sums themselves: no cast that could overflow

    def __init__(self, params: list[nn.Parameter], pool: BufferPool | None = None) -> None:
        self.params = params
        self.device = params[0].device if params else torch.device("cpu")
        self.pool = pool
        # The pool's tap, kept from step to step (else one of this step's own, detached by release()).
        self.tap, found_inf = pool.tap(params) if pool is not None else _new_tap(params)
        self.tap.begin()  # found_inf cleared, no squares yet
        self.found_inf = [found_inf]
        self.noise = NoiseSums(self.device, folded=True, host=self.tap.squares)
        self.sum_nonfinite: torch.Tensor | None = None  # never set: the final check shares found_inf
        self.batch_sq: float | None = None  # |sum|^2 of the final sums, set by finish()
        # Whether a parameter's gradient came in parts within one micro-batch (reentrant
        # checkpointing, a second backward): autograd accumulated it as it does without the noise,
        # but the squares taken are not the micro-batches' own (:meth:`micro_sums` says NaN). Set
        # by finish() (each call into the tap costs a step microseconds).
        self.split = False

    @property
    def got(self) -> list[bool]:
        """Which parameters got a gradient (the step began with every ``.grad`` None)."""
        return [p.grad is not None for p in self.params]

    def weigh(self, loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
        """``loss * weight`` for the micro-batch about to run its backward (its gradients then come
        weighed, as autograd's ``.grad`` takes them), begun in the tap with the same call: its
        squares add up apart from the last one's."""
        self.noise.add(weight)
        return self.tap.weigh(loss, weight)

    def micro_sums(self) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        if self.batch_sq is None:  # before finish(), which reads them
            self.tap.read_pending()
        sq, count = self.noise.sums()
        return (math.nan if self.split else sq), count

    def mul_(self, factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            self.tap.read_pending()  # squares of the gradients as taken, not as rescaled
            scale_([p.grad for p in self.params if p.grad is not None], factor)

    def nonfinite(self, device: torch.device) -> torch.Tensor:
        # The kept tap's flag itself (on the CPU, .to() copies nothing): the step reads it in its one
        # read, before the next step's begin() clears it in place.
        return self.found_inf[0].to(device)

    def finish(self, factor: float | torch.Tensor, got_any: list[bool] | None = None, group: Any = None) -> None:
        """Rescale the sums (already the ``.grad``: a parameter no micro-batch reached has none);
        their squared norm and non-finite check in one read. One process: ``got_any`` (this
        process's own) and ``group`` (None) say nothing here."""
        self.mul_(factor)
        # A host number: the final sums' flag joins the micro-batches' own, one flag to read.
        self.batch_sq, self.split = self.tap.finish()  # the hooks off, as release() would
        self.release()

    def release(self) -> None:
        """Take the tap's hooks off (after :meth:`finish`, or when a step fails: the step's rollback
        clears the ``.grad`` it left); the tap itself goes where no pool keeps it, or where it saw
        gradients in parts (the world takes no tap from then on)."""
        if self.batch_sq is None:  # finish() did not run
            self.tap.end()
        if self.pool is None:
            self.tap.detach()
        elif self.split:
            self.pool.drop_tap()


def takes_grads(params: list[nn.Parameter], dtype: torch.dtype) -> bool:
    """Whether :class:`TakenGrads` can accumulate ``params`` in ``dtype``: on the CPU (where
    :func:`~mbs_ext.ops.noise_tap` runs), each of that dtype (its gradients are the sums), and
    not under compiled autograd (which traces the backward's hooks, and cannot trace the tap's
    C++ one: the buffers' path then reads the gradients after each backward)."""
    return (bool(params) and all(p.is_cpu and p.dtype == dtype for p in params)  # is_cpu: no device object
            and not _compiled_autograd())


def _compiled_autograd() -> bool:
    """Whether backward runs under compiled autograd now (its module is loaded only once used)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(module is not None and getattr(module, "compiled_autograd_enabled", False))


def _new_tap(params: list[nn.Parameter]) -> tuple[Any, torch.Tensor]:
    """A noise tap over ``params`` (off until its ``begin()``) and the flag it sets on inf/NaN."""
    found_inf = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    return noise_tap(params, found_inf), found_inf


class BufferPool:
    """The flat buffers of a step, kept for the next step to reuse, and the noise scale's tap.

    A step's buffers become its ``.grad`` (views into them), and the next step drops those views
    first thing; its buffers are then the same again. Taking them anew each step costs more than
    zeroing them: fresh pages fault in and the old ones go back to the system (0.2-0.3 ms of a
    20 ms step on the CPU MLP study, 1.6 MB of buffer). A buffer is reused only where nothing
    else holds its memory: a ``.grad`` the caller kept (or a view of one) stays theirs, and the
    step takes a new buffer. One buffer per device and dtype, kept only where its views became the
    ``.grad`` (:meth:`GradBuffers.release`): memory a step holds between steps anyway."""

    def __init__(self) -> None:
        self.flats: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.kept_tap: tuple[list[nn.Parameter], Any, torch.Tensor] | None = None

    def tap(self, params: list[nn.Parameter]) -> tuple[Any, torch.Tensor]:
        """The noise tap over ``params`` and its flag (:class:`TakenGrads`), kept from the last step
        where it was over these very parameters: a new one costs a step tens of microseconds on
        the CPU (its state, its flag, the parameters' accumulation nodes). Its hooks are on only
        within a step (from the second micro-batch to the tap's ``end()``)."""
        kept = self.kept_tap
        if kept is not None and len(kept[0]) == len(params) and all(a is b for a, b in zip(kept[0], params)):
            return kept[1], kept[2]
        self.drop_tap()
        tap, found_inf = _new_tap(params)
        self.kept_tap = (list(params), tap, found_inf)
        return tap, found_inf

    def drop_tap(self) -> None:
        """Let go of the kept tap (the parameters' accumulation nodes it holds): a step that reads
        gradients otherwise (compiled autograd, which cannot trace its hooks), or one whose
        gradients came in parts."""
        if self.kept_tap is not None:
            self.kept_tap[1].detach()
            self.kept_tap = None

    def zeros(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer of ``length`` elements: the last one, where nothing else holds it."""
        flat = self.flats.get((device, dtype))
        if flat is not None and flat.numel() == length and _held_only_here(flat):
            return flat.zero_()
        flat = self.flats[device, dtype] = torch.zeros(length, dtype=dtype, device=device)
        return flat

    def drop(self, flat: torch.Tensor) -> None:
        """Forget ``flat`` (freed once nothing else holds it)."""
        key = (flat.device, flat.dtype)
        if self.flats.get(key) is flat:
            del self.flats[key]


def _held_only_here(flat: torch.Tensor) -> bool:
    """Whether ``flat`` is the only tensor on its memory (no view of it, no ``.grad`` made from it)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # Two: the tensor's storage and the Python storage object made here to ask.
    return use_count is not None and use_count(flat.untyped_storage()._cdata) == 2


class GradBuffers:
    """Flat accumulation buffers (one per device) with a view per parameter.

    Views start on 16-byte boundaries (:func:`buffer_layout`); the padding between them
    belongs to no view, so nothing reads it as a gradient.
    """

    folds = False  # the op weighs each micro-batch's gradient on its way in
    casts = True  # .grad may be a cast of the sums (into fp16: checked for overflow)
    split = False  # each micro-batch's gradient is read whole, after its backward

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, noise: bool = False,
                 pool: BufferPool | None = None) -> None:
        self.params = params
        self.pool = pool
        self.kept: list[torch.Tensor] = []  # buffers whose views finish() made the .grad
        self.views: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        self.flats: list[torch.Tensor] = []
        self.found_inf: list[torch.Tensor] = []  # one 0-dim float32 flag per device
        self.got = [False] * len(params)
        self.sum_nonfinite: torch.Tensor | None = None  # set by finish(): inf/NaN in the final sums
        groups: dict[torch.device, list[int]] = {}
        for j, p in enumerate(params):
            groups.setdefault(p.device, []).append(j)
        self.groups = list(groups.values())
        for js in self.groups:
            dev = params[js[0]].device
            offsets, length = buffer_layout([params[j].numel() for j in js], dtype.itemsize)
            flat = pool.zeros(length, dtype, dev) if pool is not None else torch.zeros(length, dtype=dtype, device=dev)
            for j, offset in zip(js, offsets):
                self.views[j] = _view_like(flat, offset, params[j])
            self.flats.append(flat)
            self.found_inf.append(torch.zeros((), dtype=torch.float32, device=dev))
        self.device = params[self.groups[0][0]].device if self.groups else torch.device("cpu")
        self.noise = NoiseSums(self.device) if noise else None
        self.batch_sq: torch.Tensor | None = None  # with ``noise``: |sum|^2 of the final sums, set by finish()

    def add_(self, scale: float | torch.Tensor) -> None:
        """``buffer += scale * p.grad`` for every parameter with a grad, then drop the grad."""
        params = self.params
        squares = self.noise.slot() if self.noise is not None else None
        for js, flag in zip(self.groups, self.found_inf):
            have = [j for j in js if params[j].grad is not None]
            if not have:
                continue
            s = scale.to(flag.device) if isinstance(scale, torch.Tensor) else scale
            # A sparse gradient (nn.Embedding(sparse=True)) adds into its dense buffer like any
            # other: the buffers, and so the .grad cast from them, are dense.
            accs = [self.views[j] for j in have]
            grads = [g.to_dense() if g.is_sparse else g for g in (params[j].grad for j in have)]
            if self.noise is None:
                scale_accumulate_(accs, grads, s, flag)  # one crossing into C++: checks and kernel
            elif flag.device == squares.device:  # the same pass also sums the gradient's squares
                scale_accumulate_(accs, grads, s, flag, sq_norm=squares)
            else:  # (noise scale), on each device, added up on the first
                sq = torch.zeros((), dtype=torch.float64, device=flag.device)
                scale_accumulate_(accs, grads, s, flag, sq_norm=sq)
                squares.add_(sq.to(squares.device))
            for j in have:
                self.got[j] = True
                params[j].grad = None
        if self.noise is not None:
            self.noise.add(scale)

    def micro_sums(self) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """:meth:`NoiseSums.sums` (``0.0, 0.0`` without the noise scale)."""
        return (0.0, 0.0) if self.noise is None else self.noise.sums()

    def mul_(self, factor: float | torch.Tensor) -> None:
        if not isinstance(factor, torch.Tensor) and factor == 1.0:
            return  # counts known before the first micro-batch weighed it exactly already
        for flat in self.flats:
            flat.mul_(factor.to(flat.device) if isinstance(factor, torch.Tensor) else factor)

    def nonfinite(self, device: torch.device) -> torch.Tensor:
        """0-dim float32 on ``device``: 1.0 when any accumulated gradient held inf/NaN."""
        found = torch.zeros((), dtype=torch.float32, device=device)
        for flag in self.found_inf:
            found = torch.maximum(found, flag.to(device))
        return found

    def finish(self, factor: float | torch.Tensor, got_any: list[bool] | None = None, group: Any = None) -> None:
        """Rescale the sums, add them up over the DDP ``group``, cast them into ``.grad``.

        Parameters no micro-batch reached (on any rank: ``got_any``; None, this process's own)
        keep ``.grad = None``.
        """
        got_any = self.got if got_any is None else got_any
        self.mul_(factor)
        if group is not None:
            self.all_reduce(group)
        # Finite micro-batch gradients can add up past the buffer dtype's range, here or in
        # the sum over ranks: one fused check of the final sums (equal on every rank); with the
        # noise scale their squared norm too, in the same read on the CPU.
        if self.noise is not None and self.flats:
            self.batch_sq, self.sum_nonfinite = squares_and_nonfinite(self.flats, self.device)
        else:
            self.sum_nonfinite = nonfinite_flag(self.flats, self.flats[0].device) if self.flats else None
        for flat, js in zip(self.flats, self.groups):
            # The buffer's views themselves become the gradients (no copy) only where every slot
            # of the buffer does: a view would otherwise keep alive, between steps, the slots of
            # parameters no micro-batch reached and of those whose gradient is a cast copy.
            shared = all(got_any[j] and self._same_as_param(j) for j in js)
            for j in js:
                self.params[j].grad = (self.views[j] if shared else self._copy(j)) if got_any[j] else None
            if shared:
                self.kept.append(flat)
        self.release()

    def _same_as_param(self, j: int) -> bool:
        p, view = self.params[j], self.views[j]
        return view.dtype == p.dtype and not p.is_sparse and view.stride() == p.stride()

    def _copy(self, j: int) -> torch.Tensor:
        """A gradient of its own for parameter ``j``, laid out like its parameter."""
        grad = torch.empty_like(self.params[j], memory_format=torch.preserve_format)
        grad.copy_(self.views[j])
        return grad

    def all_reduce(self, group: Any) -> None:
        """Sum the buffers over the ranks of ``group``: one all-reduce per device."""
        for flat in self.flats:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)

    def release(self) -> None:
        """Drop the buffers (after :meth:`finish`, or when a step fails). The pool keeps only
        those whose views became the ``.grad`` (memory held between steps anyway); a buffer
        cast into ``.grad``, or one of a step that failed, is freed as it was before the pool."""
        if self.pool is not None:
            for flat in self.flats:
                if not any(flat is kept for kept in self.kept):
                    self.pool.drop(flat)
        self.views = [None] * len(self.params)  # type: ignore[list-item]
        self.flats = []
        self.kept = []


def squares_and_nonfinite(flats: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum(f ** 2)`` over the flat buffers as a 0-dim float64 on ``device``, and their non-finite
    flag (0-dim float32): on the CPU in one native read (:func:`mbs_ext.ops.sum_squares_`, the
    op's own loop without the update), elsewhere a row-wise norm and torch's fused check."""
    if all(f.device.type == "cpu" for f in flats) and device.type == "cpu":
        sq = torch.zeros((), dtype=torch.float64)
        found = torch.zeros((), dtype=torch.float32)
        sum_squares_(flats, sq, found)
        return sq, found
    return sum(sum_of_squares(f).to(device) for f in flats), nonfinite_flag(flats, flats[0].device)


SQ_ROWS = 1024  # elements per row of sum_of_squares' float32 partial sums


def sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """``sum(flat ** 2)`` as a 0-dim float64, in one read. A float64 norm of a float32 tensor
    casts all of it first (a float64 copy, twice its size: on the CPU MLP study 2.2x slower);
    here rows of :data:`SQ_ROWS` elements take their norms in the tensor's own dtype (within
    about 1e-7 each, measured 2e-9 over 400,000 elements) and the float64 sum adds them up.
    A row whose squares pass float32's range (elements past about 1e19) gives inf: a noise
    sample the averages then skip. The step's non-finite check never reads this."""
    if flat.dtype == torch.float64:
        return torch.linalg.vector_norm(flat).square()
    n = flat.numel()
    head = n - n % SQ_ROWS
    total = torch.linalg.vector_norm(flat[:head].view(-1, SQ_ROWS), dim=1).double().square().sum()
    if head < n:
        total = total + torch.linalg.vector_norm(flat[head:]).double().square()
    return total


def _view_like(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """A view of ``p.numel()`` elements of ``flat`` from ``offset``, with ``p``'s strides when ``p``
    is dense (channels_last included), so each micro-batch's gradient (which autograd lays
    out like its parameter) meets an accumulator of the same layout. One ``as_strided`` (a
    third of the cost of ``narrow`` then ``view``: it runs for every parameter every step)."""
    # empty_like keeps the strides of a dense, non-overlapping tensor (and only of such one).
    if p.is_contiguous() or torch.empty_like(p, device="meta").stride() == p.stride():
        return flat.as_strided(p.shape, p.stride(), offset)
    return flat.narrow(0, offset, p.numel()).view(p.shape)


def rescale_grads(params: list[nn.Parameter], factor: float | torch.Tensor) -> None:
    """``p.grad *= factor`` in one fused launch (nothing to do for a host factor of 1)."""
    scale_([p.grad for p in params if p.grad is not None], factor)


def scale_(tensors: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """``t *= factor`` for every tensor, in one fused launch per dtype (none for a host 1)."""
    if not tensors or (not isinstance(factor, torch.Tensor) and factor == 1.0):
        return
    if not isinstance(factor, torch.Tensor):
        torch._foreach_mul_(tensors, factor)
        return
    # A device factor (float64 when counts are taken on the device) in each tensor's dtype:
    # foreach's fused launch takes a 0-dim tensor only of the tensors' own dtype, and falls
    # back to one multiply per tensor otherwise.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, factor.to(dtype))


def nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor on ``device``: 1.0 when any grad holds inf/NaN (no host sync).

    torch's fused check covers every floating dtype except bf16 on CUDA, which falls back
    to one reduction per tensor (only reached when ``.grad`` itself is bf16).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    if grads and all(g.dtype == grads[0].dtype and g.device == device and not g.is_sparse for g in grads):
        groups[device, grads[0].dtype] = grads  # the usual case: one group
    else:
        for g in grads:
            # A sparse gradient (nn.Embedding(sparse=True)) holds inf/NaN only in its stored
            # values: the check runs on those (the fused check takes dense tensors only).
            g = g._values() if g.is_sparse else g
            groups.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (dev, dtype), gs in groups.items():
        if not (dtype == torch.bfloat16 and dev.type == "cuda"):
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            # inv_scale 1.0: a check only (the 1.0 made once per device, not every step).
            torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, _one(dev))
        else:
            flag = (~torch.stack([torch.isfinite(g).all() for g in gs]).all()).to(torch.float32)
        flags.append(flag if dev == device else flag.to(device))
    if len(flags) == 1:
        return flags[0]
    return torch.stack(flags).amax() if flags else torch.zeros((), dtype=torch.float32, device=device)


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on ``device``, made once (read-only: the unscale factor of a check)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def overflow_on_cast(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """1.0 when a finite float32 sum did not fit an fp16 ``.grad`` (fp16's range is small)."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.dtype == torch.float16]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return nonfinite_flag(grads, device)


class AutogradSink:
    """Gradients add up in ``.grad`` through autograd; a micro-batch's weight rides on its loss."""

    buffered = False

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.device = device
        self.found: torch.Tensor | None = None  # non-finite flag over all FSDP2 ranks

    def local_nonfinite(self) -> torch.Tensor:
        """This rank's non-finite flag: of its shards of the gradients under FSDP2."""
        grads = [p.grad for p in self.params]
        # Plain tensors as they are (one type test each, not a call): DTensors only under FSDP2.
        return nonfinite_flag([g if type(g) is torch.Tensor else _local(g) for g in grads if g is not None],
                              self.device)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor, scaler: Any) -> None:
        loss = loss * (weight.to(loss.dtype) if isinstance(weight, torch.Tensor) else weight)
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def rescale(self, factor: float | torch.Tensor) -> None:
        rescale_grads(self.params, factor)

    def nonfinite(self, clipping: bool) -> torch.Tensor:
        if clipping:  # the norm computed for clipping covers it (a global one under FSDP2)
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return self.found if self.found is not None else self.local_nonfinite()

    def release(self) -> None:
        pass


class BufferSink:
    """Gradients add up in float buffers (:class:`GradBuffers`), cast into ``.grad`` once at the end."""

    buffered = True

    def __init__(self, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype,
                 noise: bool = False, pool: BufferPool | None = None, take: bool = False) -> None:
        self.params = params
        self.device = device
        if not take and pool is not None:
            pool.drop_tap()  # this step reads its gradients otherwise
        self.bufs = TakenGrads(params, pool) if take else GradBuffers(params, dtype, noise, pool)
        self.found: torch.Tensor | None = None  # non-finite flag over all DDP ranks

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor, scaler: Any) -> None:
        bufs = self.bufs
        if bufs.folds:  # the weight rides the loss, as with autograd's .grad (the tap's micro-batch begun)
            loss = bufs.weigh(loss, weight)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if not bufs.folds:
            bufs.add_(weight)

    def rescale(self, factor: float | torch.Tensor) -> None:
        self.bufs.mul_(factor)

    def local_nonfinite(self) -> torch.Tensor:
        """This rank's non-finite flag, before the buffers are summed over ranks."""
        return self.bufs.nonfinite(self.device)

    def presence(self) -> list[bool]:
        """Which parameters got a gradient from this rank's micro-batches."""
        return list(self.bufs.got)

    def micro_batches(self) -> float | torch.Tensor:
        """This rank's micro-batches of a count other than 0, or 0.0 without the noise scale."""
        return self.bufs.micro_sums()[1]

    def micro_sq(self, denom: float | torch.Tensor) -> float | torch.Tensor:
        """``sum_j c_j |grad_j|^2`` over this rank's micro-batches (``w_j = c_j / denom``: each
        micro-batch's count over the provisional total), or 0.0 without the noise scale."""
        if self.bufs.noise is None:
            return 0.0
        sq = self.bufs.micro_sums()[0]  # a host number on the CPU, else a device tensor
        if isinstance(sq, torch.Tensor) and isinstance(denom, torch.Tensor):
            denom = denom.to(sq.device)
        return sq * denom

    def finish(self, factor: float | torch.Tensor, got_any: list[bool] | None = None, group: Any = None,
               found: torch.Tensor | None = None) -> None:
        """Rescale the sums, add them up over the DDP ``group``, cast them into ``.grad``;
        ``found`` is the non-finite flag over all ranks (the summed buffers carry every
        rank's inf/NaN, so every rank must skip alike)."""
        self.found = found
        self.bufs.finish(factor, got_any, group)

    def nonfinite(self, clipping: bool) -> torch.Tensor:
        """inf/NaN in any micro-batch's gradient (on any rank), in the rescaled sums (after the
        sum over ranks: a float32 sum of finite gradients can overflow), or on the cast into fp16."""
        found = self.found if self.found is not None else self.bufs.nonfinite(self.device)
        if self.bufs.sum_nonfinite is not None:
            found = torch.maximum(found, self.bufs.sum_nonfinite.to(self.device))
        return torch.maximum(found, overflow_on_cast(self.params, self.device)) if self.bufs.casts else found

    def release(self) -> None:
        self.bufs.release()


def make_sink(params: list[nn.Parameter], device: torch.device, dtype: torch.dtype | None,
              noise: bool = False, pool: BufferPool | None = None, alone: bool = False) -> AutogradSink | BufferSink:
    """The sink for ``params``: float buffers of ``dtype`` (taken from ``pool`` where given), or
    autograd's own ``.grad`` (None); ``noise``: the buffers also sum each micro-batch's squared
    gradient norm (needs buffers), in the gradients themselves where one process (``alone``)
    can (:func:`takes_grads`)."""
    if dtype is None:
        return AutogradSink(params, device)
    return BufferSink(params, device, dtype, noise, pool, take=noise and alone and takes_grads(params, dtype))
