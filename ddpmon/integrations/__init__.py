"""ddpmon for the frameworks that build the DDP model for you. Each module imports its
framework, an optional extra; ``import ddpmon`` imports none of them.

- ``ddpmon.integrations.lightning.DDPMonCallback``: PyTorch Lightning (``ddpmon[lightning]``)
- ``ddpmon.integrations.transformers.DDPMonCallback``: Hugging Face Trainer (``ddpmon[transformers]``)
- ``ddpmon.integrations.accelerate.attach``: what ``accelerator.prepare`` returned (``ddpmon[accelerate]``)

Without changing the script at all: ``ddpmon run`` (docs/integrations.md).
"""
