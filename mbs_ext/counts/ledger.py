"""Where a step keeps each micro-batch's loss and count: a fixed block, folded when it fills.

The step needs, after its last micro-batch, ``sum_i c_i * loss_i``, ``sum_i c_i``, the first
invalid device count and, on the failure path only, the first non-finite loss. Keeping every
micro-batch's detached loss (and device count) in a list until then made memory grow with the
number of micro-batches, and not by their few bytes: each was allocated while that
micro-batch's activations and gradients were live, and under glibc's default thresholds such a
small survivor, carved out of a freed gradient-sized block, keeps the heap from reusing it. A
step of 1,024 micro-batches of 2 rows then held hundreds of MiB more than one of 8 (measured by
the OS: ``tests/test_flat_memory.py``).

Here the values are copied into slots of a block allocated once, at the first micro-batch
(one copy per micro-batch, the loss and the count dropped with the micro-batch), and every
``BLOCK`` micro-batches the block folds into running sums on the device (a few operations, no
read) and is reused. A step keeps O(1) device memory and ``BLOCK`` host numbers whatever its
length; no allocation made during a micro-batch outlives it. Nothing here reads a device value.

The same on the CPU, where reading each loss would be cheaper: a read per micro-batch is what
the step must not do on a GPU, and the CPU runs the GPU's code path so that the tests of the one
host read per step (``tests/test_syncs.py``) cover it. A step of one micro-batch keeps its loss
and count as they are (one, so nothing to bound), which costs no copy.
"""

from __future__ import annotations

import math

import torch

Count = float | torch.Tensor  # a host number, or a 0-dim float64 tensor on the device

BLOCK = 128  # micro-batches per block: folds every BLOCK (about 1 KiB of slots per kind)


class Ledger:
    """The losses and counts of one step's micro-batches ``0, 1, ...`` on ``device``."""

    def __init__(self, device: torch.device, num_micro_batches: int) -> None:
        self.device = device
        self.size = max(1, min(BLOCK, num_micro_batches))
        self._losses: torch.Tensor | None = None  # the block's slots, made at the first loss
        self._loss_views: list[torch.Tensor] = []
        self._counts: torch.Tensor | None = None  # slots of device counts, made at the first one
        self._count_views: list[torch.Tensor] = []
        self.start = 0  # the index of the block's first micro-batch
        self._host: list[float | None] = []  # per slot: the host count, or None for a device count
        self._has_loss: list[bool] = []
        self.host_total = 0.0
        self.device_total: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None
        self.invalid_at: torch.Tensor | float = 0.0  # 1 + the index of the first invalid device count
        self.nonfinite_at: torch.Tensor | float = 0.0  # ... of the first non-finite loss, in folded blocks
        # One micro-batch (the whole mini-batch): its count and loss are kept as they are, no slots
        # (nothing outlives a micro-batch that the next one could be kept from reusing).
        self.single = num_micro_batches == 1
        self._only: list = [None, None]  # its (device count, loss)
        self._settled = False
        self.factor = 1.0  # what the loss sum is to be multiplied by once read (a lone micro-batch's host count)

    def count(self, index: int, c: Count) -> None:
        """Micro-batch ``index``'s count (indices come in order, from 0)."""
        if index - self.start >= self.size:
            self._fold(final=False)
            self.start = index
        if isinstance(c, torch.Tensor) and self.single:
            self._only[0] = c
            self._host.append(None)
        elif isinstance(c, torch.Tensor):
            if self._counts is None:
                self._counts = torch.zeros(self.size, dtype=torch.float64, device=self.device)
                self._count_views = list(self._counts.unbind())
            self._count_views[len(self._host)].copy_(c)
            self._host.append(None)
        else:
            self.host_total += c
            self._host.append(c)
        self._has_loss.append(False)

    def loss(self, loss: torch.Tensor) -> None:
        """The latest counted micro-batch's detached loss."""
        if self.single:
            self._only[1] = loss
            self._has_loss[-1] = True
            return
        if self._losses is None:
            self._losses = torch.zeros(self.size, dtype=torch.float64, device=self.device)
            self._loss_views = list(self._losses.unbind())
        self._loss_views[len(self._host) - 1].copy_(loss)
        self._has_loss[-1] = True

    def totals(self) -> tuple[Count, torch.Tensor]:
        """Fold what is left: ``(sum c_i, sum c_i * loss_i)`` (the total a device tensor where
        any count is one); invalid device counts are marked in ``invalid_at``."""
        if not self._settled:  # once: a second call (a world asking again) must not add the block twice
            self._fold(final=True)
            self._settled = True
        loss_sum = self.loss_sum
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.device_total is None:
            return self.host_total, loss_sum
        total = self.device_total
        return (total + self.host_total if self.host_total else total), loss_sum

    def first_nonfinite(self) -> torch.Tensor | float:
        """1 + the index of the first non-finite loss (0: none), as a device mark; for the failure
        path, after :meth:`totals`."""
        n = len(self._host)
        if self.single and self._only[1] is not None:
            return _first(0.0, ~torch.isfinite(self._only[1].reshape(1)), 0)
        if not n or self._losses is None:
            return self.nonfinite_at
        return _first(self.nonfinite_at, ~torch.isfinite(self._losses[:n]), self.start)

    def _fold(self, final: bool) -> None:
        """The block's sums into the running ones; a block to be reused also marks its first
        non-finite loss (its values are about to go)."""
        n, host = len(self._host), self._host
        if not n:
            return
        if self.single:
            self._fold_only()
            return
        for j in range(n):  # no loss (skipped) or a host count of 0: adds nothing, even a NaN mean
            if self._losses is not None and (not self._has_loss[j] or host[j] == 0):
                self._loss_views[j].zero_()
        if self._losses is not None:
            part = self._weighted_sum(n)
            self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
        if self._counts is not None:
            on_device = [j for j in range(n) if host[j] is None]
            counts = self._counts[:n] if len(on_device) == n else self._counts[torch.tensor(on_device)]
            total = counts.sum()
            self.device_total = total if self.device_total is None else self.device_total + total
            bad = ~((counts >= 0) & (counts < math.inf))  # negative, NaN or inf
            if len(on_device) == n:
                self.invalid_at = _first(self.invalid_at, bad, self.start)
            else:  # a block of mixed counts (rare): positions by index
                where = torch.tensor(on_device, dtype=torch.float64, device=self.device)
                self.invalid_at = _first(self.invalid_at, bad, self.start, where)
        if not final and self._losses is not None:
            self.nonfinite_at = _first(self.nonfinite_at, ~torch.isfinite(self._losses[:n]), self.start)
        if not final:
            self._host, self._has_loss = [], []

    def _fold_only(self) -> None:
        """The one micro-batch of a step that streams one: its count and loss as they are."""
        c, loss = self._only
        if c is not None:  # a device count
            self.device_total = c
            self.invalid_at = _first(0.0, ~((c >= 0) & (c < math.inf)).reshape(1), 0)
            if loss is not None:
                value = loss.to(torch.float64)
                self.loss_sum = torch.where(c > 0, value * c, torch.zeros_like(value))
        elif loss is not None and self._host[0] != 0:
            # The loss as it is, its host count applied on the host after the one read: no operation.
            self.loss_sum, self.factor = loss, self._host[0]

    def _weighted_sum(self, n: int) -> torch.Tensor:
        """``sum_j c_j * loss_j`` over the block's first ``n`` slots, in float64."""
        host = self._host
        if all(c is not None for c in host):  # the usual case: host counts
            if n == 1:
                return self._loss_views[0] * host[0]
            if self.device.type == "cpu":  # a host tensor of weights is no copy here
                return self._losses[:n] @ torch.tensor(host, dtype=torch.float64)
            return torch.stack(torch._foreach_mul(self._loss_views[:n], host)).sum()  # no host-to-device copy
        values, counts = self._losses[:n], self._counts[:n]
        weighted = torch.where(counts > 0, values * counts, torch.zeros_like(values))  # a zero count adds no NaN
        if any(c is not None for c in host):  # mixed: the host counts' slots weigh their own count
            weights = torch.tensor([0.0 if c is None else c for c in host], dtype=torch.float64)
            is_host = torch.tensor([c is not None for c in host])
            weights, is_host = weights.to(self.device), is_host.to(self.device)
            weighted = torch.where(is_host, values * weights, weighted)
        return weighted.sum()


def _first(earlier: torch.Tensor | float, flags: torch.Tensor, start: int,
           where: torch.Tensor | None = None) -> torch.Tensor | float:
    """Combine an earlier mark (1 + index, 0: none) with the first true flag of a block that starts
    at index ``start`` (``where``: the slots' own positions in the block, when not ``0..n-1``)."""
    as_float = flags.to(torch.float64)
    position = as_float.argmax()  # the first of equal maxima
    if where is not None:
        position = where[position]
    mark = (position + (1 + start)) * as_float.amax()
    if isinstance(earlier, float) and earlier == 0.0:
        return mark
    return torch.where(torch.as_tensor(earlier, device=mark.device) > 0, earlier, mark)
