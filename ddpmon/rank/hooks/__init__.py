"""Hooks that ddpmon puts on a DDP model: comm (buckets), autograd (gradients), step."""
