"""The Lightning warm-up seed: an optimizer_step override that forgot the closure (CPU, seconds).

Without ampguard, Lightning 2.x stops with "The closure hasn't been executed". With
``ampguard.install()`` the model trains, and one AmpGuardWarning names the line and the fix.
"""

import logging
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import ampguard

ampguard.install()  # before or after importing Lightning: both work

import lightning.pytorch as L  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class WarmupModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.training_steps = 0

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        # LR warm-up over the first 10 steps...
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * min(1.0, (self.trainer.global_step + 1) / 10)
        optimizer.step()  # ...and the bug: should be optimizer.step(closure=optimizer_closure)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x.sum(dim=1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    model = WarmupModel()
    before = torch.nn.functional.mse_loss(model.net(x), y).item()
    trainer = L.Trainer(max_epochs=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, data)
    after = torch.nn.functional.mse_loss(model.net(x), y).item()
    stats = ampguard.active().stats
    print(f"training_step ran {model.training_steps} times for {trainer.global_step} optimizer steps")
    print(f"loss {before:.3f} -> {after:.3f}; closures injected by ampguard: {stats.closures_injected}")


if __name__ == "__main__":
    main()
