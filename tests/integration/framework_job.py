"""One rank of a framework's 2-process CPU job with ddpmon: ``python framework_job.py
FRAMEWORK OUT_DIR`` (under torchrun for transformers and accelerate; Lightning starts its
second process itself). Tiny models built from code, no download. Each rank writes
``result-<rank>.json``: the framework's own step count and what ddpmon saw."""

import json
import os
import sys

import torch
from torch import nn

STEPS, ACCUMULATE, BATCH = 4, 2, 4


def dataset(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def write(out, rank, **result):
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)


def lightning(out):
    import lightning.pytorch as pl

    from ddpmon.integrations.lightning import DDPMonCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = DDPMonCallback(port=0, state_dir=os.path.join(out, "state"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(dataset(), batch_size=BATCH))
    write(out, trainer.global_rank, framework_steps=trainer.global_step, state_file=callback.monitor.state_file)


def transformers(out):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ddpmon.integrations.transformers import DDPMonCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.arange(i, i + 8) % 32
            return {"input_ids": ids, "labels": ids}

    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=os.path.join(out, "hf"), per_device_train_batch_size=BATCH, max_steps=STEPS,
        gradient_accumulation_steps=ACCUMULATE, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    callback = DDPMonCallback(port=0, state_dir=os.path.join(out, "state"))
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    write(out, trainer.args.process_index, framework_steps=trainer.state.global_step,
          wrapped=type(trainer.model_wrapped).__name__, state_file=callback.monitor.state_file)


def accelerate(out):
    from accelerate import Accelerator

    import ddpmon

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    monitor = ddpmon.attach(model, port=0, state_dir=os.path.join(out, "state"))  # the one line
    updates = 0
    for i, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        updates += accelerator.sync_gradients
        if updates == STEPS:
            break
    monitor.detach()
    write(out, accelerator.process_index, framework_steps=updates, wrapped=type(model).__name__,
          state_file=monitor.state_file)


if __name__ == "__main__":
    {"lightning": lightning, "transformers": transformers, "accelerate": accelerate}[sys.argv[1]](sys.argv[2])
