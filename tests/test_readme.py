"""The README's API block runs as written on the set-up the README installs (a CPU build where
there is no GPU), given a loader of host batches: a newcomer's first copy-and-paste works."""

from __future__ import annotations

import torch
from common import ROOT


def _api_block() -> str:
    text = (ROOT / "README.md").read_text()
    api = text[text.index("\n## API"):]
    start = api.index("```python\n") + len("```python\n")
    return api[start:api.index("```", start)]


def test_the_readme_api_block_runs_on_this_machine():
    loader = [(torch.randn(130, 784), torch.randint(0, 10, (130,))) for _ in range(2)]  # host batches
    scope: dict = {"loader": loader}
    exec(compile(_api_block(), "README.md (API)", "exec"), scope)  # noqa: S102 - the README's own code
    r = scope["r"]
    assert r.num_micro_batches == 3 and r.micro_batch_size == 44 and not r.skipped
    assert next(scope["model"].parameters()).device.type == ("cuda" if torch.cuda.is_available() else "cpu")
