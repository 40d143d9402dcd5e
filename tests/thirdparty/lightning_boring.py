"""Lightning's own demo model (``lightning.pytorch.demos.boring_classes.BoringModel``: a
Linear(32, 2) on 64 random samples), trained by Lightning's DDP strategy on CPU as its docs
show; nothing downloaded. Usage: lightning_boring.py STEPS."""

import sys

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_steps=int(sys.argv[1]),
    limit_val_batches=0,
    num_sanity_val_steps=0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(BoringModel())
