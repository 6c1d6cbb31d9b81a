"""Micro-batches shaped by tokens (``micro_batch_tokens``): rows grouped by length, each
micro-batch trimmed to its longest row, the step equal to the full-batch step on the padded
batch; what would make it differ (left padding, labels at padding positions, a row longer
than the budget) refused before anything changes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from common import graph_recorder
from torch import nn

import mbs_ext

VOCAB, WIDTH = 37, 24


def padded_batch(n: int = 14, width: int = WIDTH, seed: int = 0, left: bool = False) -> dict:
    """Right-padded (or left-padded) rows of random lengths; labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    lengths[0] = width  # one full row
    lengths[1] = 1
    ids = torch.randint(1, VOCAB, (n, width), generator=g)
    positions = torch.arange(width)
    real = positions >= (width - lengths)[:, None] if left else positions < lengths[:, None]
    mask = real.long()
    return {"input_ids": ids.masked_fill(~real, 0), "attention_mask": mask,
            "labels": ids.masked_fill(~real, -100)}


def label_count(batch: dict) -> torch.Tensor:
    """The label tokens a causal LM's loss scores (shifted by one)."""
    return (batch["labels"][:, 1:] != -100).sum()


class TinyLM(nn.Module):
    """A model that reads every sequence leaf: a per-token loss over real positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.out = nn.Linear(8, VOCAB, dtype=torch.float64)

    def forward(self, input_ids, attention_mask, labels):
        h = self.emb(input_ids).cumsum(1) * attention_mask[..., None]
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def tiny_loss(model, batch):
    return model(**batch)


def grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_plan_groups_rows_within_the_budget():
    lengths = torch.tensor([5, 17, 3, 17, 9, 1, 12, 8, 0, 16])
    plan = mbs_ext.plan_tokens(lengths, 34, micro_batch_size=3)
    assert sorted(plan.order.tolist()) == list(range(10))
    assert sum(plan.sizes) == 10 and all(1 <= s <= 3 for s in plan.sizes)
    start = 0
    for size, width in zip(plan.sizes, plan.widths):
        rows = plan.order[start:start + size]
        assert size * width <= 34
        assert int(lengths[rows].max().clamp(min=1)) == width  # trimmed to its longest row
        start += size
    assert plan.widths == sorted(plan.widths, reverse=True)  # the longest first
    assert 0 <= plan.padding < 0.3
    with pytest.raises(ValueError, match="micro_batch_tokens=16: row 1 has 17 tokens"):
        mbs_ext.plan_tokens(lengths, 16)


def test_options():
    assert mbs_ext.StepOptions(micro_batch_tokens=64).micro_batch_size is None
    assert mbs_ext.StepOptions(micro_batch_tokens="auto").micro_batch_tokens == "auto"
    with pytest.raises(ValueError, match="micro_batch_tokens must be an int >= 1, 'auto' or None, got 'max'"):
        mbs_ext.StepOptions(micro_batch_tokens="max")
    with pytest.raises(TypeError, match="micro_batch_tokens must be an int >= 1, 'auto' or None, got float"):
        mbs_ext.StepOptions(micro_batch_tokens=64.0)
    with pytest.raises(ValueError, match="micro_batch_size is a cap on rows"):
        mbs_ext.StepOptions(micro_batch_size="auto", micro_batch_tokens=64)
    with pytest.raises(TypeError, match="micro_batch_size is required"):
        mbs_ext.StepOptions()
    with pytest.raises(ValueError, match="token_lengths is read only with micro_batch_tokens"):
        mbs_ext.StepOptions(micro_batch_size=2, token_lengths="mask")


@pytest.mark.parametrize("cap", [None, 3])
@pytest.mark.parametrize("use_indices", [False, True])
def test_tiny_model_step_equals_full_batch(cap, use_indices):
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    data = padded_batch(n=20)
    indices = torch.tensor([3, 0, 7, 7, 12, 19, 5, 1, 9, 14, 2]) if use_indices else None
    batch = data if indices is None else {k: v[indices] for k, v in data.items()}
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    ref_opt.zero_grad()
    loss = tiny_loss(ref, batch)
    loss.backward()
    ref_opt.step()
    result = mbs_ext.step(model, opt, data, tiny_loss, indices=indices, micro_batch_tokens=2 * WIDTH,
                          micro_batch_size=cap, normalize=lambda b: (b["labels"] != -100).sum())
    assert result.num_micro_batches > 1
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("use_indices", [False, True])
def test_an_error_names_the_rows_of_the_failing_micro_batch(use_indices):
    """The note names rows by their numbers in the mini-batch (or the dataset), not by their
    positions in the grouped order; the plan says which rows micro-batch 1 holds."""
    data = padded_batch(n=20)
    indices = torch.tensor([3, 0, 7, 7, 12, 19, 5, 1, 9, 14, 2]) if use_indices else None
    lengths = data["attention_mask"].sum(1) if indices is None else data["attention_mask"][indices].sum(1)
    plan = mbs_ext.plan_tokens(lengths, 2 * WIDTH, rows=indices)
    want = plan.order[plan.sizes[0] : plan.sizes[0] + plan.sizes[1]].tolist()
    seen = []

    def failing(model, mb):
        seen.append(mb["input_ids"].clone())
        if len(seen) == 2:
            raise RuntimeError("injected")
        return tiny_loss(model, mb)

    model = TinyLM()
    with pytest.raises(RuntimeError, match="injected") as info:
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.5), data, failing, indices=indices,
                     micro_batch_tokens=2 * WIDTH)
    assert torch.equal(seen[1], data["input_ids"][want][:, : seen[1].shape[1]])  # the rows the loss really got
    where = "the dataset" if use_indices else "the mini-batch"
    listed = ", ".join(map(str, want[:8])) + (f", ... ({len(want)} rows)" if len(want) > 8 else "")
    assert f"micro-batch 1 of {len(plan.sizes)} (rows {listed} of {where}, grouped by length)" in "\n".join(
        info.value.__notes__)


def test_a_non_finite_loss_names_the_rows_of_its_micro_batch():
    """The non-finite check of the finish names rows as the error note does: by their numbers."""
    data = padded_batch(n=20)
    plan = mbs_ext.plan_tokens(data["attention_mask"].sum(1), 2 * WIDTH)
    want = plan.order[plan.sizes[0] : plan.sizes[0] + plan.sizes[1]].tolist()
    calls = []

    def nan_second(model, mb):
        calls.append(1)
        loss = tiny_loss(model, mb)
        return loss * float("nan") if len(calls) == 2 else loss

    model = TinyLM()
    with pytest.raises(FloatingPointError) as info:
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.5), data, nan_second,
                     micro_batch_tokens=2 * WIDTH, on_nonfinite="raise")
    listed = ", ".join(map(str, want[:8])) + (f", ... ({len(want)} rows)" if len(want) > 8 else "")
    assert f"non-finite loss at micro-batch 1 of {len(plan.sizes)} (rows {listed} of the mini-batch, grouped" in str(
        info.value)


class TokenLimitLM(TinyLM):
    """Raises a real torch.OutOfMemoryError where a micro-batch holds more than ``limit`` token
    positions (rows x width), as a device would."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.shapes = limit, []

    def forward(self, input_ids, attention_mask, labels):
        self.shapes.append(tuple(input_ids.shape))
        if input_ids.numel() > self.limit:
            raise torch.OutOfMemoryError(f"injected: {input_ids.numel()} token positions > {self.limit}")
        return super().forward(input_ids, attention_mask, labels)


def test_out_of_memory_shrinks_the_token_budget_and_stays_exact():
    """Back-off bisects micro_batch_tokens (not rows): probes run the plan's heaviest trimmed
    micro-batch; the step is redone at the budget found, equal to the full batch, and later
    steps start there."""
    model = TokenLimitLM(limit=2 * WIDTH)
    ref = copy.deepcopy(model)
    ref.limit = 10**9
    data = padded_batch(n=20)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    loss = tiny_loss(ref, data)
    loss.backward()
    ref_opt.step()
    # check_count=False: the count check's forwards after the first step would enter model.shapes.
    streamer = mbs_ext.MicroBatchStreamer(model, opt, tiny_loss, micro_batch_tokens=6 * WIDTH,
                                          normalize=lambda b: (b["labels"] != -100).sum(), check_count=False)
    with pytest.warns(RuntimeWarning, match=r"out of memory at micro_batch_tokens=144; redoing the step with "
                                            r"micro_batch_tokens=(\d+)") as caught:
        result = streamer.step(data)
    found = int(str(caught[0].message).rsplit("=", 1)[1])
    assert WIDTH <= found < 6 * WIDTH
    redo = model.shapes[-result.num_micro_batches:]
    assert all(rows * width <= min(found, 2 * WIDTH) for rows, width in redo), redo
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    model.shapes.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget found is remembered: no second out-of-memory
        again = streamer.step(data)
    assert again.num_micro_batches == result.num_micro_batches
    assert all(rows * width <= found for rows, width in model.shapes)


def test_auto_plans_a_token_budget_from_the_memory_budget_and_stays_exact():
    """micro_batch_tokens="auto" plans rows of the longest length into memory_budget: a larger
    budget plans more tokens, every micro-batch keeps to what was planned, and the step equals
    the full batch; a budget that holds nothing is refused naming memory_budget."""
    data = padded_batch(n=40)
    longest = int(data["attention_mask"].sum(1).max())
    planned = {}
    for budget in (100_000, 400_000):
        model = TokenLimitLM(limit=10**9)  # records the shapes it is given
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        loss = tiny_loss(ref, data)
        loss.backward()
        ref_opt.step()
        result = mbs_ext.step(model, opt, data, tiny_loss, micro_batch_tokens="auto", memory_budget=budget,
                              normalize=lambda b: (b["labels"] != -100).sum(), check_count=False)
        planned[budget] = result.micro_batch_tokens
        assert isinstance(planned[budget], int) and planned[budget] >= longest
        streamed = model.shapes[-result.num_micro_batches:]
        assert all(rows * width <= planned[budget] for rows, width in streamed), streamed
        assert result.loss == pytest.approx(loss.item(), rel=1e-12)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert planned[400_000] > planned[100_000]
    model = TinyLM()
    with pytest.raises(ValueError, match="memory_budget=1000 bytes is too small"):
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.5), data, tiny_loss, micro_batch_tokens="auto",
                     memory_budget=1000)


def test_a_budget_that_no_longest_row_fits_raises_the_error_with_a_note():
    model = TokenLimitLM(limit=WIDTH - 1)  # the full row (WIDTH tokens) never fits
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torch.OutOfMemoryError) as info:
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.5), padded_batch(n=20), tiny_loss,
                     micro_batch_tokens=4 * WIDTH)
    assert "found no token budget that fits, not even one that holds the longest row" in "\n".join(
        info.value.__notes__)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_micro_batches_are_trimmed_and_bounded():
    seen = []

    def loss_fn(model, batch):
        seen.append(tuple(batch["input_ids"].shape))
        assert batch["attention_mask"].shape == batch["labels"].shape == batch["input_ids"].shape
        assert bool(batch["attention_mask"][:, -1].any())  # no column of padding only
        return tiny_loss(model, batch)

    # check_count=False: the count check would call loss_fn three more times after the step
    result = mbs_ext.accumulate(TinyLM(), padded_batch(n=30), loss_fn, micro_batch_tokens=40, check_count=False)
    assert sum(rows for rows, _ in seen) == 30
    assert result.micro_batch_size == max(rows for rows, _ in seen)  # the largest, not the first
    assert all(rows * width <= 40 for rows, width in seen)
    assert seen[0][1] == WIDTH and min(w for _, w in seen) < WIDTH


@pytest.mark.parametrize(("change", "match"), [
    ("left", "left-padded"),
    ("holes", "not padded at the end only"),
    ("labels", "holds targets at padding positions"),
    ("long", "row 0 has 24 tokens"),
    ("no_mask", "has no 2-d 'attention_mask' leaf"),
])
def test_refused_before_anything_changes(change, match):
    model = TinyLM()
    batch = padded_batch(left=change == "left")
    if change == "holes":
        batch["attention_mask"][2, 0] = 0
    if change == "labels":
        batch["labels"] = batch["input_ids"].clone()
    if change == "no_mask":
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(ValueError, match=match):
        mbs_ext.step(model, opt, batch, tiny_loss, micro_batch_tokens=20 if change == "long" else 4 * WIDTH)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and bool((p.grad == 7.0).all())


def test_lengths_by_key_and_by_callable():
    data = padded_batch()
    mask = data.pop("attention_mask")
    batch = {**data, "keep": mask}

    def loss_fn(model, b):
        return tiny_loss(model, {"input_ids": b["input_ids"], "attention_mask": b["keep"], "labels": b["labels"]})

    model = TinyLM()
    full = loss_fn(copy.deepcopy(model), batch).item()
    by_key = mbs_ext.accumulate(model, batch, loss_fn, micro_batch_tokens=48, token_lengths="keep",
                                normalize=lambda b: (b["labels"] != -100).sum())
    by_call = mbs_ext.accumulate(model, batch, loss_fn, micro_batch_tokens=48,
                                 token_lengths=lambda b: b["keep"].sum(1),
                                 normalize=lambda b: (b["labels"] != -100).sum())
    assert by_key.loss == pytest.approx(full, rel=1e-12) and by_call.loss == pytest.approx(full, rel=1e-12)
    with pytest.raises(ValueError, match="one length per row"):
        mbs_ext.accumulate(model, batch, loss_fn, micro_batch_tokens=48, token_lengths=lambda b: b["keep"])


def _ranks_worker(rank, wrapper):
    """Rank 0 takes the batch's first 13 rows, rank 1 the other 7: different lengths, different
    numbers of token micro-batches, under DDP or FSDP2. Returns the stepped parameters (full
    tensors) and the micro-batch count."""
    torch.manual_seed(0)
    model = TinyLM()
    if wrapper == "ddp":
        stepped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        fully_shard(model.emb, mesh=mesh)
        stepped = fully_shard(model, mesh=mesh)
    data = padded_batch(n=20)
    rows = slice(0, 13) if rank == 0 else slice(13, 20)
    mine = {k: v[rows] for k, v in data.items()}
    opt = torch.optim.SGD(stepped.parameters(), lr=0.5)
    result = mbs_ext.step(stepped, opt, mine, tiny_loss, micro_batch_tokens=2 * WIDTH,
                          normalize=lambda b: (b["labels"] != -100).sum())
    params = [getattr(p, "full_tensor", lambda p=p: p)().detach().clone() for p in model.parameters()]
    return params, result.num_micro_batches


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_ranks_with_different_token_micro_batches_equal_one_process(wrapper):
    from ddp_harness import run_world

    out = run_world(_ranks_worker, wrapper, timeout=120)
    assert out[0][1] != out[1][1]  # the ranks ran different numbers of micro-batches
    torch.manual_seed(0)
    ref = TinyLM()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    tiny_loss(ref, padded_batch(n=20)).backward()
    opt.step()
    for params, _ in out:
        for p, q in zip(params, ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # dynamo traces the model
def test_compiled_model_is_not_recompiled_per_shape():
    counting, graphs = graph_recorder()
    torch._dynamo.reset()
    model = TinyLM()
    compiled = torch.compile(model, backend=counting)
    shapes = set()
    batch = padded_batch(n=40)

    def loss_fn(m, b):
        shapes.add(tuple(b["input_ids"].shape))
        return m(**b)

    for _ in range(2):
        mbs_ext.accumulate(compiled, batch, loss_fn, micro_batch_tokens=3 * WIDTH, micro_batch_size=12,
                           normalize=lambda b: (b["labels"] != -100).sum())
    assert len(shapes) >= 4
    # Rows and width are traced as symbols from the first micro-batch on; a size of 1 (a row
    # alone, a one-token width) is one more graph where dynamo specializes it.
    assert len(graphs) <= 2, (len(graphs), sorted(shapes))
