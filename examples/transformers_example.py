"""Train a tiny causal LM with the Hugging Face Trainer, streaming each batch of 64 rows
through the model 8 rows at a time (runs on the CPU in seconds; no downloads).

    python examples/transformers_example.py

Every Trainer feature stays: AdamW, the schedule, clipping, logging. One step equals the
plain Trainer's step on the whole batch of 64; the model never sees more than 8 rows.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from mbs_ext.integrations.transformers import StreamingTrainer


class PaddedRows(torch.utils.data.Dataset):
    """Random right-padded sequences; padding is ignored in the loss (labels -100)."""

    def __init__(self, n=128, length=16, vocab=100):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        lengths = torch.randint(2, length + 1, (n, 1), generator=g)
        self.mask = (torch.arange(length) < lengths).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = torch.where(self.mask[i].bool(), self.ids[i], -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def main():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # what transformers maps GPT-2 to, said explicitly (no warning)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out, per_device_train_batch_size=64,  # the mini-batch of one optimizer step
            max_steps=4, learning_rate=3e-3, lr_scheduler_type="cosine", max_grad_norm=1.0,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            dataloader_pin_memory=torch.cuda.is_available(), disable_tqdm=True,
        )
        trainer = StreamingTrainer(model=model, args=args, train_dataset=PaddedRows(), micro_batch_size=8)
        trainer.train()
    print(f"largest batch the model saw: {max(seen)} rows (mini-batch 64)")


if __name__ == "__main__":
    main()
