"""What the tests share: the one CUDA flag and device parameters, the float64 host
references and comparisons, small models, losses and data, and the one child-process runner.

The reference for a streamed step on any device is an ordinary full-batch step of a
float64 copy of the model on the host (:func:`reference_model`, :func:`to_f64`), so a
CUDA result is checked against something computed independently of CUDA and of the
micro-batch split.

A test that needs a fresh interpreter runs it through :func:`run_python` (this checkout
importable, output captured, a timeout or a failure shown with the child's output and
its Python stacks); one that needs several ranks of a gloo world uses
``ddp_harness.run_world``.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import mbs_ext

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose mbs_ext is tested
TESTS = ROOT / "tests"

CUDA = torch.cuda.is_available() and bool(mbs_ext.build_info()["cuda_compiled"])

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and mbs_ext built with CUDA")

# For @pytest.mark.parametrize("device", DEVICE_PARAMS) where the `device` fixture
# cannot be used (module-scoped fixtures, hypothesis tests): CUDA cases skip cleanly.
DEVICE_PARAMS = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]


def graph_recorder() -> tuple[Any, list]:
    """A ``torch.compile`` backend that runs each graph dynamo hands it as traced, and the list it
    appends those graphs to: how many graphs a run compiled (a recompile is one more)."""
    graphs: list = []

    def recording(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    return recording, graphs


def reference_model(model: nn.Module) -> nn.Module:
    """An independent float64 copy of ``model`` on the host, for full-batch references."""
    return copy.deepcopy(model).to("cpu", torch.float64)


def to_f64(batch: Any) -> Any:
    """``batch`` on the host with floating tensors in float64 (others unchanged)."""

    def cast(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach().to("cpu")
        return x.double() if x.is_floating_point() else x

    return pytree.tree_map(cast, batch)


def scaler_for(device: str, **kw: Any) -> torch.amp.GradScaler:
    """A GradScaler for ``device`` ("cpu" or "cuda")."""
    return torch.amp.GradScaler(torch.device(device).type, **kw)


def balanced_sizes(n: int, m: int) -> list[int]:
    """The micro-batch sizes step promises for n rows at micro_batch_size m, written out
    independently of mbs_ext: k = ceil(n/m) sizes differing by at most one, larger first."""
    k = -(-n // m)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def balanced_ranges(n: int, m: int) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges of :func:`balanced_sizes`."""
    out, start = [], 0
    for size in balanced_sizes(n, m):
        out.append((start, start + size))
        start += size
    return out


def failing_at(call: int, exc_type: type[BaseException], loss_fn):
    """``loss_fn`` that raises ``exc_type("injected")`` on its ``call``-th call (0-based)."""
    calls = []

    def failing(model, batch):
        calls.append(1)
        if len(calls) == call + 1:
            raise exc_type("injected")
        return loss_fn(model, batch)

    return failing


def full_batch_step(model, optimizer, batch, loss_fn, scaler=None, max_grad_norm=None):
    """The reference: one ordinary backward over the whole mini-batch."""
    optimizer.zero_grad()
    loss = loss_fn(model, batch)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    norm = None
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return loss.item(), norm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in norm, in float64 on the host (a and b may live on different devices)."""
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def assert_models_match(model, ref, tol: float) -> None:
    """Same grads (None where the reference has None) and the same parameters."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: expected no grad"
        else:
            assert p.grad is not None, f"{name}: missing grad"
            assert rel_err(p.grad, q.grad) <= tol, f"{name}: grad rel err {rel_err(p.grad, q.grad)}"
        assert rel_err(p, q) <= tol, f"{name}: param rel err {rel_err(p, q)}"


def snapshot(model, optimizer=None, scaler=None) -> dict:
    """Bit-exact copies of everything a step may change."""
    snap = {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
    }
    if optimizer is not None:
        st = optimizer.state_dict()
        snap["opt"] = {
            k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
            for k, v in st["state"].items()
        }
        snap["opt_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in st["param_groups"]]
    if scaler is not None:
        snap["scaler"] = scaler.state_dict()
    return snap


def _compare(a, b, tensors, where: str = "state") -> None:
    """Walk two nested state structures together; ``tensors(x, y, where)`` checks tensor leaves."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        tensors(a, b, where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _compare(a[k], b[k], tensors, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _compare(u, v, tensors, f"{where}[{i}]")
    else:
        assert a == b, where


def _same_bits(x, y, where):
    assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), where


def assert_bit_identical(a: dict, b: dict) -> None:
    _compare(a, b, _same_bits)


def assert_states_match(a: dict, b: dict, tol: float) -> None:
    """Like :func:`assert_bit_identical` for ``tol == 0``; otherwise tensors within ``tol``
    relative error (for comparing two runs of the same step on CUDA, whose kernels are
    not promised to be bit-reproducible)."""
    if tol == 0:
        assert_bit_identical(a, b)
        return

    def close(x, y, where):
        if x.is_floating_point():
            assert rel_err(x, y) <= tol, f"{where}: rel err {rel_err(x, y)}"
        else:
            assert torch.equal(x.cpu(), y.cpu()), where

    _compare(a, b, close)


# --- a token-masked causal-LM-like model ---------------------------------------------------


class MLP(nn.Module):
    """4 -> 5 -> 2 with tanh, its forward defined here, not in torch.nn: ``torch.compile(DDP(model))``
    skips frames of torch's own modules (DDP.forward, nn.Sequential.forward), so it would
    compile nothing of an nn.Sequential and quietly run it eagerly."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def lm_loss(model, batch):
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def token_count(batch):
    return (batch["labels"] != -100).sum()


class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``value`` (inf or NaN): a
    finite loss whose gradient is not, an injected fault. ``PoisonGrad.apply(x, value)``."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.value, None


class ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``/``float(t)``/``bool(t)`` (a host sync
    on a GPU); and ``Tensor.tolist`` calls, which read a whole tensor at once without that op
    on the CPU (the finish reads everything it needs with one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


# --- the step tests' small regression model and data ------------------------------------------


def mlp(dtype=torch.float64, seed=0, d_in=5, d_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out)).to(dtype)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def pair(n, dtype=torch.float64, seed=1, d_in=5, d_out=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=dtype), torch.randn(n, d_out, generator=g, dtype=dtype)


def twins(model, opt_cls=torch.optim.Adam, *, device="cpu", **opt_kw):
    """The model moved to ``device`` with its optimizer, and a float64 host reference with its own."""
    ref = reference_model(model)
    model = model.to(device)
    opt_kw = opt_kw or {"lr": 1e-2}
    return model, opt_cls(model.parameters(), **opt_kw), ref, opt_cls(ref.parameters(), **opt_kw)


class Boom(Exception):
    """An injected failure no library raises."""


# --- child processes ----------------------------------------------------------------------------

_TAIL = 6000  # characters of each output stream a failure shows


def _failure(what: str, argv: list[str], out: str | bytes | None, err: str | bytes | None) -> str:
    def tail(s: str | bytes | None) -> str:
        s = s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
        return s if len(s) <= _TAIL else "..." + s[-_TAIL:]

    shown = " ".join(argv[1:]).replace("\n", "; ")
    shown = shown if len(shown) <= 300 else shown[:300] + "..."
    return f"child `python {shown}` {what}\n--- stdout ---\n{tail(out)}\n--- stderr ---\n{tail(err)}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own process group
    except ProcessLookupError:
        pass


def run_python(args_or_code: str | Sequence[str | os.PathLike], *, timeout: float,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
               check: bool = True, path: Sequence[str | os.PathLike] = ()) -> subprocess.CompletedProcess:
    """Run a fresh interpreter: ``python -c CODE`` for a string, ``python *ARGS`` for a sequence
    (a script and its arguments, or ``["-m", module, ...]``); text output captured.

    ``env`` is the child's whole environment (this process's by default); the checkout's root,
    then ``path``, go first on its ``PYTHONPATH``, so the child imports the mbs_ext under test.

    Nothing here can leave a test stuck or fail it mutely: a child still running after
    ``timeout`` seconds is sent SIGABRT (``PYTHONFAULTHANDLER`` is set, so it prints its Python
    stacks), then killed with its process group, and the test fails showing its output; with
    ``check`` (the default) a non-zero exit fails the test showing its output. With
    ``check=False`` the caller judges ``returncode`` itself.
    """
    __tracebackhide__ = True  # a failure points at the test's call, not in here
    code = isinstance(args_or_code, str)
    argv = [sys.executable, "-c", args_or_code] if code else [sys.executable, *map(str, args_or_code)]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, path), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONFAULTHANDLER", "1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something else of its group holds the pipes open
            _kill_group(proc)
            out, err = proc.communicate()
        _kill_group(proc)
    except BaseException:  # an interrupt: the child is in a session of its own, so stop it here
        _kill_group(proc)
        proc.wait()
        raise
    if timed_out:
        pytest.fail(_failure(f"timed out after {timeout:g} s (its stacks are on stderr)", argv, out, err))
    if check and proc.returncode != 0:
        why = f"exited with {proc.returncode}"
        if proc.returncode < 0:
            why += " (a signal: a native crash or a kill)"
        pytest.fail(_failure(why, argv, out, err))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
