"""The gradient noise scale of a step, measured from its own micro-batches.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", Appendix A): with
``G_b`` the mean gradient over ``b`` samples, ``E|G_b|^2 = |G|^2 + S / b`` where ``S`` is the
trace of the per-sample gradient covariance; the simple noise scale ``B_simple = S / |G|^2``
predicts the critical batch size. A streamed step holds both gradients it needs: each
micro-batch's mean gradient ``g_j`` over its ``b_j`` items (rows, or the loss's count) and
their exact weighted mean ``G_B`` over all ``B = sum_j b_j`` items. Then

    S      ~= (sum_j b_j |g_j|^2 - B |G_B|^2) / (m - 1)
    |G|^2  ~= |G_B|^2 - S / B

over the ``m`` micro-batches of the step (every rank's: they are micro-batches of one global
step). Over random splits of a fixed mini-batch into micro-batches of any sizes, the first is
unbiased for the trace of the sample covariance of the mini-batch's per-item gradients
(denominator ``B - 1``): ``sum_j b_j |g_j - G_B|^2`` has expectation ``(m - 1)`` times it. For
equal ``b_j`` the formula is McCandlish's two-batch-size estimator taken at ``b`` and ``B``.

One step's ``S`` and ``|G|^2`` are noisy (the second can come out negative): the critical batch
size is the ratio of their moving averages (not the average of ratios), :class:`NoiseScale`,
with a standard error by the delta method over the averages' effective number of steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseSample:
    """One step's sums: ``micro_batches`` (m, every rank's), ``items`` (B), ``micro_sq``
    (``sum_j b_j |g_j|^2``) and ``batch_sq`` (``|G_B|^2``), in the unscaled gradient's units."""

    micro_batches: int
    items: float
    micro_sq: float
    batch_sq: float

    @property
    def trace(self) -> float | None:
        """``S``, the trace of the per-item gradient covariance (None with one micro-batch)."""
        if self.micro_batches < 2 or self.items <= 0:
            return None
        return (self.micro_sq - self.items * self.batch_sq) / (self.micro_batches - 1)

    @property
    def grad_sq(self) -> float | None:
        """``|G|^2``, the squared norm of the true gradient, unbiased (None with one micro-batch)."""
        trace = self.trace
        return None if trace is None else self.batch_sq - trace / self.items


@dataclass(frozen=True)
class Noise:
    """What a step says of its gradient noise (``StepResult.noise``).

    ``trace`` and ``grad_sq``: this step's ``S`` and ``|G|^2``; ``b_simple``: ``S / |G|^2`` from
    the moving averages of both over ``steps`` steps (None until they hold a positive ``|G|^2``),
    with ``b_simple_stderr`` (None before two steps); ``micro_batches``, ``items``, ``micro_sq``,
    ``batch_sq``: the step's sums (:class:`NoiseSample`)."""

    trace: float | None
    grad_sq: float | None
    b_simple: float | None
    b_simple_stderr: float | None
    steps: int
    micro_batches: int
    items: float
    micro_sq: float
    batch_sq: float


class NoiseScale:
    """Moving averages of ``S`` and ``|G|^2`` over steps (decay ``beta``, bias-corrected as Adam's
    moments are), their second moments for the standard error, and the ratio.

    A step with one micro-batch, or a non-finite sum (a skipped step), leaves the averages as
    they were. The averages are of per-item quantities, so they stay valid when the mini-batch
    size changes between steps. ``state_dict()`` / ``load_state_dict()`` carry them across a
    resume."""

    MOMENTS = ("s", "g", "ss", "gg", "sg")

    def __init__(self, beta: float = 0.95) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"noise_beta must be a float in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.steps = 0
        self.moments = dict.fromkeys(self.MOMENTS, 0.0)

    def update(self, sample: NoiseSample) -> Noise:
        """Fold one step in and say what the averages give."""
        trace, grad_sq = sample.trace, sample.grad_sq
        if trace is not None and math.isfinite(trace) and math.isfinite(grad_sq):
            self.steps += 1
            b = self.beta
            for key, value in zip(self.MOMENTS, (trace, grad_sq, trace * trace, grad_sq * grad_sq, trace * grad_sq)):
                self.moments[key] = b * self.moments[key] + (1.0 - b) * value
        b_simple, stderr = self.ratio()
        # The sample's fields by name (dataclasses.asdict deep-copies: a tenth of a millisecond a step).
        return Noise(trace, grad_sq, b_simple, stderr, self.steps, sample.micro_batches, sample.items,
                     sample.micro_sq, sample.batch_sq)

    @property
    def b_simple(self) -> float | None:
        """``B_simple`` from the averages so far (what a schedule reads: :class:`mbs_ext.Autopilot`)."""
        return self.ratio()[0]

    @property
    def b_simple_stderr(self) -> float | None:
        """The standard error of :attr:`b_simple` (None before two steps)."""
        return self.ratio()[1]

    def ratio(self) -> tuple[float | None, float | None]:
        """``B_simple`` from the averages and its standard error (delta method)."""
        if not self.steps:
            return None, None
        correction = 1.0 - self.beta ** self.steps
        s, g, ss, gg, sg = (self.moments[k] / correction for k in self.MOMENTS)
        if g <= 0.0:
            return None, None
        b_simple = s / g
        if self.steps < 2:
            return b_simple, None
        # Effective number of steps in an exponential average: (sum w)^2 / sum w^2.
        b = self.beta
        n_eff = (correction / (1.0 - b)) ** 2 / ((1.0 - b ** (2 * self.steps)) / (1.0 - b * b)) if b else 1.0
        var_s, var_g, cov = max(ss - s * s, 0.0), max(gg - g * g, 0.0), sg - s * g
        rel = var_s / (s * s) if s else 0.0
        rel += var_g / (g * g) - (2.0 * cov / (s * g) if s else 0.0)
        return b_simple, abs(b_simple) * math.sqrt(max(rel, 0.0) / max(n_eff, 1.0))

    def state_dict(self) -> dict:
        return {"beta": self.beta, "steps": self.steps, "moments": dict(self.moments)}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
        self.steps = int(state["steps"])
        self.moments = {k: float(state["moments"][k]) for k in self.MOMENTS}
