"""The peak a step adds does not grow with its number of micro-batches, by the OS.

Each size runs in a fresh child process with glibc's default malloc settings (how users run):
one warm-up step, then one step of ``k`` micro-batches of 2 rows, and the rise of ``VmHWM``
(reset through ``/proc/self/clear_refs``) over ``VmRSS`` just before it. At k = 1,024 the step
must add what it adds at k = 8 within ``TOL_MIB``. Before the work on bounded memory, the
BatchNorm model added 152-180 MiB more at 1,024 (a row of statistics per micro-batch per layer)
and the count-callable MLP up to 1.4 GiB more (each micro-batch's kept loss pinned a freed
gradient-sized block of the heap); a correct step moves by a few MiB (page and heap slack).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from common import ROOT, run_python

TOL_MIB = 12.0
CHILD = r"""
import json, sys, warnings, torch, mbs_ext
from torch import nn
warnings.simplefilter("ignore")
torch.set_num_threads(1)
case, k = sys.argv[1], int(sys.argv[2])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
torch.manual_seed(0)
m = 2
if case == "batchnorm":
    layers = []
    for _ in range(12):
        layers += [nn.Conv2d(512, 512, 1), nn.BatchNorm2d(512), nn.ReLU()]
    model, x = nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 4, 5)), torch.randn(k * m, 512, 2, 2)
else:
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 5))
    x = torch.randn(k * m, 512)
y = torch.randint(0, 5, (k * m,))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
kw = {"normalize": lambda mb: (mb[1] >= 0).sum()} if case == "device_counts" else {}
loss = lambda mdl, mb: nn.functional.cross_entropy(mdl(mb[0]), mb[1])
mbs_ext.step(model, opt, (x[: 4 * m], y[: 4 * m]), loss, micro_batch_size=m, **kw)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
r = mbs_ext.step(model, opt, (x, y), loss, micro_batch_size=m, **kw)
print(json.dumps({"k": r.num_micro_batches, "rise_mib": (status("VmHWM") - before) / 2**20}))
"""

pytestmark = [pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"),
              pytest.mark.slow]


def _rise(case: str, k: int) -> dict:
    done = run_python(["-c", CHILD, case, str(k)], timeout=300, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["batchnorm", "device_counts", "plain"])
def test_peak_of_a_step_does_not_grow_with_its_micro_batches(case):
    few, many = _rise(case, 8), _rise(case, 1024)
    assert (few["k"], many["k"]) == (8, 1024)
    assert many["rise_mib"] - few["rise_mib"] <= TOL_MIB, (case, few, many)
