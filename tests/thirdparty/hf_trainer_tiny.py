"""transformers.Trainer as its docs show it, on a tiny randomly initialised GPT-2 built from a
config (2 layers, width 32, vocabulary 64) and random token sequences: nothing downloaded.
Usage: hf_trainer_tiny.py OUTPUT_DIR STEPS."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
args = TrainingArguments(
    output_dir=sys.argv[1],
    max_steps=int(sys.argv[2]),
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    use_cpu=True,
    ddp_backend="gloo",
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(512)).train()
