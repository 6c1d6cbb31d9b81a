"""Train an unchanged LightningModule with micro-batch streaming: the only change is the strategy.

    python examples/lightning_example.py

Each batch of 256 rows stays on the host and streams through the model 32 rows at a time;
every optimizer step equals the full-batch step (exact loss normalization), and the logged
``train_loss`` is the full-batch loss. Runs on the CPU in a few seconds.
"""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mbs_ext.integrations.lightning import StreamingStrategy


class Classifier(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4  # a learnable synthetic rule
    loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)

    trainer = Trainer(
        strategy=StreamingStrategy(micro_batch_size=32),  # the whole change ("ddp": strategy="ddp")
        accelerator="cpu", max_epochs=5, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = Classifier()
    trainer.fit(model, loader)
    result = trainer.strategy.last_result
    print(f"final train_loss {trainer.callback_metrics['train_loss'].item():.4f} "
          f"({result.num_micro_batches} micro-batches of <= {result.micro_batch_size} rows per step)")


if __name__ == "__main__":
    main()
