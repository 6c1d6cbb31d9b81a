"""Run a function on every rank of a small gloo world on 127.0.0.1, with a watchdog.

``run_world(fn, *args)`` starts ``world`` processes (spawned, so each one is a fresh
interpreter), joins them into one gloo process group, calls ``fn(rank, *args)`` on
each and returns the per-rank return values (anything ``torch.save`` can store).

Nothing here can leave a CI job stuck:

* The parent holds the rendezvous store on a port the OS picked (port 0): no port
  race, no retry loop.
* The parent waits at most ``timeout`` seconds; then it asks every live rank for its
  Python stacks at once (SIGUSR1, faulthandler) and kills it. When one rank fails, the
  others get ``grace`` seconds (they may be waiting in a collective for the failed
  one) before the same. The error names every rank's exit code, its Python traceback
  and its dumped stacks. A native crash (SIGABRT, SIGSEGV) dumps the stacks too.
* Backups that fire only later, so that the parent's snapshot of *every* rank comes
  first (a rank timing out on its own would make its peers fail with "connection
  closed" instead of showing where they were): each rank arms
  ``faulthandler.dump_traceback_later`` (dump and exit, in case the parent is gone) and
  the process group's timeout, both ``timeout + BACKUP_S``.
* A rank that finished leaves through ``os._exit`` after ``destroy_process_group``:
  gloo's worker threads outlive the process group (torch 2.13, 2.14), and one still
  running while the interpreter finalizes can abort the process ("terminate called
  without an active exception") after the work is done.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
HOST = "127.0.0.1"
BACKUP_S = 60.0


class WorldFailed(AssertionError):
    """A rank failed, crashed or hung; the message holds every rank's stacks."""


def _child(rank: int, world: int, port: int, out: str, timeout: float, fn: Callable, args: tuple) -> None:
    out_dir = Path(out)
    stacks = open(out_dir / f"stacks_{rank}.txt", "w")  # noqa: SIM115 - open until the process exits
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    backup = timeout + BACKUP_S
    faulthandler.dump_traceback_later(backup, exit=True, file=stacks)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timedelta(seconds=backup))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=backup))
        result = fn(rank, *args)
        torch.save(result, out_dir / f"result_{rank}.pt")
        gc.collect()  # DDP models and their reducers go now, not during teardown
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"error_{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        # No teardown: the other ranks may be blocked in a collective with this one.
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(out_dir: Path, codes: list[int | None], why: str) -> str:
    parts = [f"{why}; exit codes by rank: {codes}"]
    for r in range(len(codes)):
        for name in (f"error_{r}.txt", f"stacks_{r}.txt"):
            f = out_dir / name
            text = f.read_text().strip() if f.exists() else ""
            if text:
                parts.append(f"--- rank {r} {name.split('_')[0]}:\n{text}")
    return "\n".join(parts)


def run_world(fn: Callable, *args: Any, world: int = WORLD, timeout: float = 90.0, grace: float = 5.0,
              out_dir: str | os.PathLike | None = None) -> list[Any]:
    """``[fn(0, *args), ..., fn(world - 1, *args)]``, each computed on its own rank of a gloo world.

    ``fn`` must be importable by name (a module-level function). Raises :class:`WorldFailed`
    with every rank's traceback and Python stacks when a rank raises, crashes, or any rank
    is still running after ``timeout`` seconds.
    """
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="ddp_world_"))
    out.mkdir(parents=True, exist_ok=True)
    # The store's server lives in this process, on a port the OS chose: nobody can take it
    # between choosing and binding. wait_for_workers=False: the ranks connect later.
    store = dist.TCPStore(HOST, 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, world, store.port, str(out), timeout, fn, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    why = None
    try:
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                # Give the others a moment to fail (or finish) on their own, then stop them.
                end = time.monotonic() + grace
                while time.monotonic() < end and any(p.is_alive() for p in procs):
                    time.sleep(0.05)
                why = "a rank failed"
                break
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f} s (a hang)"
                break
            time.sleep(0.05)
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            os.kill(p.pid, signal.SIGUSR1)  # dump its Python stacks
        if alive:
            time.sleep(1.0)
        for p in alive:
            p.kill()
        for p in procs:
            p.join(timeout=10)
        del store
    codes = [p.exitcode for p in procs]
    if why is None and any(c != 0 for c in codes):
        why = "a rank failed"
    if why is not None:
        raise WorldFailed(_report(out, codes, why))
    return [torch.load(out / f"result_{r}.pt", weights_only=False) for r in range(world)]
