"""The mini-batch size of each step, on a clock of samples, and the learning rate that follows it.

Streaming makes the batch size free: memory follows the micro-batch, and a step of any number of
rows is exact. A schedule answers ``size(samples_seen, noise)`` before each step:

* :class:`Steps` - a size per stretch of samples (``[(0, 256), (2_000_000, 512)]``);
* :class:`Ramp` - from ``start`` to ``end`` linearly over ``over`` samples, in multiples of
  ``multiple_of`` (a batch-size warm-up as Megatron's ``--rampup-batch-size``, counted in samples);
* :class:`Autopilot` - follows the step's own gradient noise scale (``noise_scale=True``,
  docs/noise-scale.md): ``B <- clip(k * B_simple, B_min, B_max)``, never down, and up only where
  the target passes the current size by ``hysteresis`` (the estimate is noisy). Hand it the
  streamer's :class:`~mbs_ext.counts.noise.NoiseScale` (``streamer.noise``): its moving averages
  are restored by the streamer's ``load_state_dict``, so a resumed run decides as the first would.

:func:`scaled_lr` couples the learning rate to the size (``"linear"``, ``"sqrt"`` for Adam, or
``"adascale"``: AdaScale's gain from the step's own noise), and :class:`SampleLR` runs a
learning-rate schedule on the same clock of samples.
Every schedule is counted in samples (or tokens), never in steps, so a run resumed at another
batch size or world size lands where it was (with :class:`mbs_ext.streaming.order.SampleOrder`);
the only schedule with a state, :class:`Autopilot`, has ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Steps:
    """A size per stretch of samples: ``milestones`` are ``(from_samples, size)`` pairs, the first
    from 0, in increasing order."""

    milestones: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        got = tuple((int(s), _size("size", b)) for s, b in self.milestones)
        if not got or got[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(got, got[1:])):
            raise ValueError(f"milestones must start at 0 samples and increase, got {self.milestones!r}")
        object.__setattr__(self, "milestones", got)

    def size(self, samples_seen: int, noise: Any = None) -> int:
        return next(b for s, b in reversed(self.milestones) if samples_seen >= s)


@dataclass(frozen=True)
class Ramp:
    """``start`` to ``end`` rows linearly over the first ``over`` samples, rounded down to a
    multiple of ``multiple_of`` (never below ``start``), then ``end``."""

    start: int
    end: int
    over: int
    multiple_of: int = 1

    def __post_init__(self) -> None:
        for name in ("start", "end", "over", "multiple_of"):
            _size(name, getattr(self, name))

    def size(self, samples_seen: int, noise: Any = None) -> int:
        if samples_seen >= self.over:
            return self.end
        raw = self.start + (self.end - self.start) * samples_seen / self.over
        return max(self.start, int(raw) // self.multiple_of * self.multiple_of)


class Autopilot:
    """``k * B_simple`` from the step's noise, clipped to ``[minimum, maximum]``, rounded down to a
    multiple of ``multiple_of``; monotone (never shrinks) with hysteresis (grows only where the
    target exceeds the current size by that fraction). It acts only on an estimate whose standard
    error is at most ``max_rel_stderr`` of it (None: on any): the first steps' averages, over few
    micro-batches, can be several times too large, and a size never comes back down. Until then,
    the size stays ``minimum``."""

    def __init__(self, minimum: int, maximum: int, k: float = 1.0, hysteresis: float = 0.25,
                 multiple_of: int = 1, max_rel_stderr: float | None = 0.5) -> None:
        self.minimum, self.maximum, self.multiple_of = (_size(n, v) for n, v in
                                                        (("minimum", minimum), ("maximum", maximum),
                                                         ("multiple_of", multiple_of)))
        self.maximum = self.maximum // self.multiple_of * self.multiple_of  # the largest size it can choose
        if self.maximum < self.minimum:
            raise ValueError(f"maximum ({maximum}, rounded down to a multiple of {multiple_of}) must be >= minimum "
                             f"({minimum})")
        if not (k > 0 and math.isfinite(k)) or not hysteresis >= 0:
            raise ValueError(f"k must be a positive number and hysteresis >= 0, got k={k!r}, hysteresis={hysteresis!r}")
        if max_rel_stderr is not None and not max_rel_stderr > 0:
            raise ValueError(f"max_rel_stderr must be a positive number or None, got {max_rel_stderr!r}")
        self.k, self.hysteresis, self.max_rel_stderr = float(k), float(hysteresis), max_rel_stderr
        self.current = self.minimum

    def _trusted(self, noise: Any) -> float | None:
        """``B_simple`` of ``noise`` where it is known and, with ``max_rel_stderr``, precise enough."""
        b_simple = getattr(noise, "b_simple", None)
        if b_simple is None or not math.isfinite(b_simple):
            return None
        if self.max_rel_stderr is not None:
            stderr = getattr(noise, "b_simple_stderr", None)
            if stderr is None or not stderr <= self.max_rel_stderr * abs(b_simple):
                return None
        return b_simple

    def size(self, samples_seen: int, noise: Any = None) -> int:
        b_simple = self._trusted(noise)
        if b_simple is not None:
            target = min(self.maximum, max(self.minimum, self.k * b_simple))
            target = max(self.minimum, int(target) // self.multiple_of * self.multiple_of)
            if target > self.current * (1.0 + self.hysteresis) or (target == self.maximum > self.current):
                self.current = target
        return self.current

    def state_dict(self) -> dict:
        return {"current": self.current}

    def load_state_dict(self, state: dict) -> None:
        self.current = int(state["current"])


def adascale_gain(b_simple: float | None, base_size: int, size: int) -> float:
    """AdaScale's gain for SGD (Johnson et al. 2020, "AdaScale SGD"): how many ``base_size``
    steps one step of ``size`` rows is worth, ``r = (s2 + g2) / (s2 / S + g2)`` with ``S`` the
    scale ``size / base_size``, ``s2`` the gradient variance at ``base_size`` and ``g2`` the
    squared norm of the true gradient. In the noise scale's terms (``s2 = tr(Sigma) / base_size``,
    ``B_simple = tr(Sigma) / g2``): ``r = (B_simple / base_size + 1) / (B_simple / size + 1)``,
    between 1 (no noise: a larger batch adds nothing) and ``S`` (all noise: it is worth ``S``
    steps). Before the noise gives ``B_simple`` (None) the gain is 1, AdaScale's own start."""
    base_size, size = _size("base_size", base_size), _size("size", size)
    if b_simple is None or not math.isfinite(b_simple):
        return 1.0
    b = max(float(b_simple), 0.0)  # a negative estimate (noise of the estimator): no noise
    return (b / base_size + 1.0) / (b / size + 1.0)


def scaled_lr(base_lr: float, base_size: int, size: int, rule: str = "linear", noise: Any = None) -> float:
    """The learning rate for a mini-batch of ``size`` rows, given ``base_lr`` at ``base_size``:
    ``"linear"`` (SGD: proportional), ``"sqrt"`` (Adam: with the square root of the ratio), or
    ``"adascale"`` (SGD: :func:`adascale_gain` from ``noise``, the streamer's
    :class:`~mbs_ext.counts.noise.NoiseScale`, whose moving averages give ``B_simple``)."""
    if rule == "linear":
        return base_lr * size / base_size
    if rule == "sqrt":
        return base_lr * math.sqrt(size / base_size)
    if rule == "adascale":
        if noise is None:
            raise ValueError("scaled_lr(rule='adascale') needs noise=: the streamer's noise (streamer.noise, with "
                             "noise_scale=True)")
        return base_lr * adascale_gain(getattr(noise, "b_simple", None), base_size, size)
    raise ValueError(f"rule must be 'linear', 'sqrt' or 'adascale', got {rule!r}")


class SampleLR:
    """A learning-rate schedule on the clock of samples (or tokens), not steps: before each step,
    ``step(seen, size)`` sets every parameter group's rate to its base rate times
    ``lr_at(seen)`` (a warm-up, a decay: a function of the samples seen so far), times the
    coupling of ``rule`` (:func:`scaled_lr`) from ``base_size`` to this step's ``size`` where
    ``rule`` is given. A step schedule counted in steps would move at a different pace as soon
    as the batch size does; this one lands where it was at any size, and on resume (its state is
    the base rates and the last clock reading)."""

    def __init__(self, optimizer: Any, lr_at: Any, base_size: int | None = None, rule: str | None = None,
                 noise: Any = None) -> None:
        if not callable(lr_at):
            raise ValueError(f"lr_at must be a function of the samples seen, got {lr_at!r}")
        if rule is not None and base_size is None:
            raise ValueError(f"SampleLR(rule={rule!r}) needs base_size=: the mini-batch size the base rates are for")
        self.optimizer, self.lr_at, self.rule, self.noise = optimizer, lr_at, rule, noise
        self.base_size = None if base_size is None else _size("base_size", base_size)
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.seen = 0

    def step(self, seen: int, size: int | None = None) -> list[float]:
        """Set the rates for the step after ``seen`` samples (of ``size`` rows); returns them."""
        if self.rule is not None and size is None:
            raise ValueError(f"SampleLR.step: size= is needed with rule={self.rule!r}")
        self.seen = int(seen)
        factor = float(self.lr_at(self.seen))
        lrs = []
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            lr = base * factor
            if self.rule is not None:
                lr = scaled_lr(lr, self.base_size, size, self.rule, self.noise)
            group["lr"] = lr
            lrs.append(lr)
        return lrs

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.base_lrs = [float(v) for v in state["base_lrs"]]
        self.seen = int(state["seen"])
