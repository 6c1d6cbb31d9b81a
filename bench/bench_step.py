"""Step overhead: mbs_ext.step vs a full-batch step, a hand-written loop, and mbp-pytorch.

At mini-batch B=512 split into k = 1, 2, 4, 8 micro-batches, on an MLP and a small
CNN (CPU). What micro-batching itself costs or saves is the hand-written loop vs the
full batch; what mbs_ext adds on top is step vs the hand-written loop, and its bookkeeping
alone is step vs the "guarded" loop (the hand-written one plus the non-finite check and the
loss read that step does by default); mbp-pytorch
(the papers' authors' package) runs at the same micro-batch size. A second study
times the two ways to accumulate micro-batch gradients (autograd into .grad with
the weight folded into the loss, vs fresh grads + the fused op) to justify the
choice step makes. All variants run side by side in one session; only ratios count.
"""

from __future__ import annotations

import importlib.util
import statistics
import warnings

import pytest
import torch
from _results import interleaved
from torch import nn

import mbs_ext

B = 512
KS = [1, 2, 4, 8]
ROUNDS = 41
# The MLP's steps take milliseconds: more rounds there narrow its medians at little cost.
ROUNDS_OF = {"mlp": 121, "cnn": ROUNDS}
_medians: dict[tuple, float] = {}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


MODELS = {"mlp": (mlp, (256,)), "cnn": (cnn, (3, 32, 32))}


def _data(model_name: str):
    gen = torch.Generator().manual_seed(1)
    shape = MODELS[model_name][1]
    return torch.randn(B, *shape, generator=gen), torch.randint(0, 10, (B,), generator=gen)


def _setup(model_name: str):
    model = MODELS[model_name][0]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    return model, opt, nn.CrossEntropyLoss()


def _full(model, opt, loss_fn, x, y, m):
    def run():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return run


def _hand(model, opt, loss_fn, x, y, m):
    def run():
        opt.zero_grad()
        for xs, ys in zip(x.split(m), y.split(m)):
            (loss_fn(model(xs), ys) * (len(ys) / B)).backward()
        opt.step()
    return run


def _guarded(model, opt, loss_fn, x, y, m):
    """The hand-written loop plus what the step does by default beyond it: no optimizer step when
    a gradient holds inf/NaN (the fused check GradScaler uses), and the mini-batch loss read as
    a number. What step costs on top of this is its bookkeeping alone."""
    params = list(model.parameters())
    one = torch.ones(1)

    def run():
        opt.zero_grad()
        losses = []
        for xs, ys in zip(x.split(m), y.split(m)):
            loss = loss_fn(model(xs), ys) * (len(ys) / B)
            loss.backward()
            losses.append(loss.detach())
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, one)
        found_inf, _loss = torch.stack([found[0], sum(losses)]).tolist()
        if not found_inf:
            opt.step()
    return run


def _step(model, opt, loss_fn, x, y, m):
    streamer = mbs_ext.MicroBatchStreamer(model, opt, loss_fn, micro_batch_size=m)
    return lambda: streamer.step((x, y))


def _mbp(model, opt, loss_fn, x, y, m):
    import mbp

    @mbp.apply(["x", "y"], ub_size=m, device="cpu")
    def train(model, loss_fn, x, y):
        return loss_fn(model(x), y)

    def run():
        opt.zero_grad()
        train(model, loss_fn, x=x, y=y)
        opt.step()
    return run


VARIANTS = {"full": _full, "hand": _hand, "guarded": _guarded, "step": _step, "mbp": _mbp}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_step_overhead(benchmark, model_name, k):
    """All variants at one (model, k), interleaved round by round."""
    x, y = _data(model_name)
    variants = dict(VARIANTS)
    if importlib.util.find_spec("mbp") is None or k == 1:
        # mbp-pytorch 0.2.6 runs only the forward pass when nothing is split (no backward).
        variants.pop("mbp")
    runs = {name: make(*_setup(model_name), x, y, B // k) for name, make in variants.items()}
    times = {name: [] for name in runs}
    rounds = ROUNDS_OF[model_name]
    benchmark.group = f"step {model_name} k={k} (one round = every variant once)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mbp warns when k=1 leaves nothing to split
        benchmark.pedantic(interleaved(runs, times), rounds=rounds, iterations=1, warmup_rounds=2)
    for name, samples in times.items():
        median = statistics.median(samples[-rounds:])
        benchmark.extra_info[f"{name}_median_s"] = median
        _medians[("step", model_name, k, name)] = median
    # The ratio within each round (the variants ran back to back there), then its median: the
    # machine's slow drifts, which move whole rounds, cancel out of it.
    paired = statistics.median(s / h for s, h in zip(times["step"][-rounds:], times["hand"][-rounds:]))
    benchmark.extra_info["step_over_hand_paired"] = paired
    _medians[("step", model_name, k, "paired")] = paired
    guarded = statistics.median(s / g for s, g in zip(times["step"][-rounds:], times["guarded"][-rounds:]))
    _medians[("step", model_name, k, "paired guarded")] = guarded


def _autograd_path(model, loss_fn, x, y, m):
    params = [p for p in model.parameters()]

    def run():
        for p in params:
            p.grad = None
        for xs, ys in zip(x.split(m), y.split(m)):
            (loss_fn(model(xs), ys) * (len(ys) / B)).backward()
    return run


def _fused_path(model, loss_fn, x, y, m):
    params = [p for p in model.parameters()]
    accs = [torch.zeros_like(p) for p in params]
    found_inf = torch.zeros(())

    def run():
        for a in accs:
            a.zero_()
        for xs, ys in zip(x.split(m), y.split(m)):
            for p in params:
                p.grad = None
            loss_fn(model(xs), ys).backward()
            mbs_ext.scale_accumulate_(accs, [p.grad for p in params], len(ys) / B, found_inf)
    return run


@pytest.mark.parametrize("model_name", list(MODELS))
def test_accumulate_path(benchmark, model_name):
    x, y = _data(model_name)
    model, _opt, loss_fn = _setup(model_name)
    runs = {
        "autograd": _autograd_path(model, loss_fn, x, y, B // 8),
        "fused": _fused_path(model, loss_fn, x, y, B // 8),
    }
    times = {name: [] for name in runs}
    benchmark.group = f"accumulate path {model_name} k=8 (one round = both paths)"
    benchmark.pedantic(interleaved(runs, times), rounds=ROUNDS, iterations=1, warmup_rounds=2)
    for name, samples in times.items():
        _medians[("path", model_name, name)] = statistics.median(samples[-ROUNDS:])


def test_report():
    """Ratios of medians, written to step.{json,md} (bench/_results.py says where)."""
    from _results import write

    rows, data = [], {}
    for name in MODELS:
        for k in KS:
            full, hand, guarded, step, mbp = (_medians.get(("step", name, k, v))
                                              for v in ("full", "hand", "guarded", "step", "mbp"))
            if None in (full, hand, guarded, step):
                pytest.skip("run the whole module to get the report")
            row = {
                "model": name, "k": k, "micro": B // k,
                "full ms": full * 1e3, "hand ms": hand * 1e3, "guarded ms": guarded * 1e3, "step ms": step * 1e3,
                "mbp ms": mbp * 1e3 if mbp else float("nan"),
                "step / hand": step / hand, "step / hand, paired": _medians[("step", name, k, "paired")],
                "step / guarded": step / guarded,
                "step / guarded, paired": _medians[("step", name, k, "paired guarded")],
                "step / mbp": step / mbp if mbp else float("nan"),
                "hand / full": hand / full,
            }
            rows.append(row)
            data[f"{name} k={k}"] = row
    paths = {
        name: {
            "autograd_s": _medians[("path", name, "autograd")],
            "fused_s": _medians[("path", name, "fused")],
            "fused / autograd": _medians[("path", name, "fused")] / _medians[("path", name, "autograd")],
        }
        for name in MODELS
        if ("path", name, "fused") in _medians
    }
    write(
        "step",
        {"B": B, "rounds": ROUNDS_OF, "results": data, "accumulate_path": paths,
         "targets": {"step / hand cnn": 1.01, "step / hand mlp": 1.05, "step / mbp": 1.0}},
        rows,
        note=f"CPU, B={B}, medians of {ROUNDS_OF['mlp']} rounds (MLP) and {ROUNDS_OF['cnn']} (CNN, and the "
        "accumulation path); in each round every variant runs once, interleaved, "
        "and 'paired' is the median over rounds of that round's ratio. 'guarded' is the hand-written loop "
        "plus the non-finite gradient check and the loss read that the step does by default; "
        f"{torch.get_num_threads()} threads. mbp at k=1 is left out: mbp-pytorch 0.2.6 runs no backward when "
        "nothing is split. "
        "Accumulation path at k=8 (fused / autograd, < 1 means the fused op is faster): "
        + ", ".join(f"{n} {v['fused / autograd']:.3f}" for n, v in paths.items()),
    )

