"""``micro_batch_tokens`` on real transformers models in float64: a GPT-2 causal LM and a
BERT-style encoder, each streamed by tokens, equal the model's own full-batch loss and step on
the padded batch (normalized by the label tokens each loss averages over); and through
``StreamingTrainer``."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.loss.loss_utils import fixed_cross_entropy  # noqa: E402

import mbs_ext  # noqa: E402

pytestmark = pytest.mark.integration

VOCAB, WIDTH, N = 41, 32, 24


def causal_lm_loss_f64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers' ForCausalLMLoss without its ``logits.float()`` (which rounds float64 to float32)."""
    labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return fixed_cross_entropy(logits.view(-1, vocab_size), labels.view(-1), num_items_in_batch, ignore_index,
                               **kwargs)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(torch.float64)
    model.loss_function = causal_lm_loss_f64
    return model


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=WIDTH, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(config).to(torch.float64)


def padded(kind: str, seed: int = 1) -> dict:
    """Right-padded rows of log-normal lengths; labels -100 on padding (and, for the encoder,
    on the positions it is not asked to predict)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(N, generator=g) * 0.6 + 2.3).exp().round().clamp(2, WIDTH).long()
    lengths[3] = WIDTH
    real = torch.arange(WIDTH) < lengths[:, None]
    ids = torch.randint(1, VOCAB, (N, WIDTH), generator=g).masked_fill(~real, 0)
    batch = {"input_ids": ids, "attention_mask": real.long()}
    if kind == "gpt2":
        batch["labels"] = ids.masked_fill(~real, -100)
    else:
        asked = real & (torch.rand(N, WIDTH, generator=g) < 0.3)
        batch["labels"] = ids.masked_fill(~asked, -100)
        batch["token_type_ids"] = torch.zeros_like(ids)
    return batch


def count(kind: str):
    if kind == "gpt2":
        return lambda b: (b["labels"][:, 1:] != -100).sum()
    return lambda b: (b["labels"] != -100).sum()


def model_loss(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_token_step_equals_the_models_full_batch_step(kind):
    model = gpt2() if kind == "gpt2" else bert()
    ref = copy.deepcopy(model)
    batch = padded(kind)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    ref_opt.zero_grad()
    loss = model_loss(ref, batch)
    loss.backward()
    ref_opt.step()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    # check_count=False: the first step's count check would add its three forwards to ``seen``.
    result = mbs_ext.step(model, opt, batch, model_loss, micro_batch_tokens=96, normalize=count(kind),
                          check_count=False)
    assert result.num_micro_batches == len(seen) > 2
    assert all(r * w <= 96 for r, w in seen) and min(w for _, w in seen) < WIDTH
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


def test_dataset_rows_by_indices():
    model = gpt2()
    data = padded("gpt2")
    indices = torch.tensor([5, 3, 3, 20, 11, 0, 17, 8, 22, 1])
    ref = copy.deepcopy(model)
    model_loss(ref, {k: v[indices] for k, v in data.items()}).backward()
    mbs_ext.accumulate(model, data, model_loss, indices=indices, micro_batch_tokens=64, micro_batch_size=3,
                       normalize=count("gpt2"))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.batch = padded("gpt2", seed=4)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


def test_streaming_trainer_by_tokens(tmp_path):
    from transformers import Trainer, TrainingArguments

    from mbs_ext.integrations.transformers import StreamingTrainer

    def train(cls, out, **kw):
        model = gpt2()
        model.loss_type = "ForCausalLM"
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=N, max_steps=2,
                                 learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                                 dataloader_pin_memory=False, disable_tqdm=True, seed=0, logging_steps=1)
        trainer = cls(model=model, args=args, train_dataset=Rows(), **kw)
        trainer.train()
        return trainer

    ref = train(Trainer, "ref")
    ours = train(StreamingTrainer, "ours", micro_batch_tokens=96)
    assert ours.last_stream_result.num_micro_batches > 2
    for p, q in zip(ours.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)


def test_the_tokens_example_takes_the_row_splits_step():
    """examples/tokens_example.py runs as a user would run it, and its two steps agree."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "examples" / "tokens_example.py")], capture_output=True,
                         text=True, timeout=300, cwd=root, check=True,
                         env=mbs_ext.diagnostics.child_env(threads=2)).stdout
    rows, tokens = (float(x) for x in re.findall(r"loss (\d+\.\d+)", out))
    assert tokens == pytest.approx(rows, rel=1e-5), out
    assert float(re.search(r"weights after the step: (\S+)", out).group(1)) < 1e-5, out
    streamed = [int(x) for x in re.findall(r"(\d+) positions streamed", out)]
    assert streamed[1] < streamed[0] / 4, out
