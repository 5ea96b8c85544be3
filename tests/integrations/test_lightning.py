"""moga in Lightning: configure_optimizers returns MOGA, and Trainer(ckpt_path=...) resumes bitwise."""

import pytest
import torch

from moga.models import GPT
from moga.optim import MOGA
from tests.integrations.lm import CharBlocks

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install moga[lightning])",
                        exc_type=ImportError)

EPOCH, BATCH = 12, 8  # steps per epoch; the checkpoint is written at the end of the first epoch


class CharGPT(L.LightningModule):
    def __init__(self, vocab_size: int, seed: int):
        super().__init__()
        self.model = GPT(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=32, tie_weights=True,
                         seed=seed)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        _, loss = self.model(ids[:, :-1], ids[:, 1:])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = MOGA(self, lr=0.02, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * EPOCH)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_lightning_trains_and_resumes_with_the_same_losses(corpus, tmp_path):
    data = CharBlocks(corpus, EPOCH * BATCH, length=33)

    def fit(seed, ckpt_path=None):
        module = CharGPT(data.vocab_size, seed)
        checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / str(seed), save_top_k=-1,
                                                          every_n_epochs=1)
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, callbacks=[checkpoints],
                            enable_progress_bar=False, enable_model_summary=False, deterministic=True)
        # Shuffled by a sampler whose order depends on the epoch alone (Lightning calls set_epoch), so the
        # resumed run draws the same order; a plain shuffle=True draws from the global RNG, which Lightning's
        # checkpoint does not restore.
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module.losses, trainer

    full, trainer = fit(seed=0)
    assert len(full) == 2 * EPOCH and sum(full[-3:]) < sum(full[:3])
    assert isinstance(trainer.optimizers[0], MOGA) and trainer.optimizers[0].plan["model.lm_head.weight"].role == "tied"
    resumed, _ = fit(seed=1, ckpt_path=tmp_path / "0" / f"epoch=0-step={EPOCH}.ckpt")  # other initial weights
    assert resumed == full[EPOCH:]  # bitwise: weights, MOGA's momentum, the schedule and the data order
