from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import ddpmon


def test_attach_on_a_plain_module_shows_how_to_wrap() -> None:
    with pytest.raises(ddpmon.AttachError) as err:
        ddpmon.attach(torch.nn.Linear(2, 2))
    msg = str(err.value)
    assert "DistributedDataParallel" in msg and "torch.nn.modules.linear.Linear" in msg
    assert "DistributedDataParallel(model)" in msg


def test_attach_before_init_process_group() -> None:
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group exists
    with pytest.raises(ddpmon.AttachError) as err:
        ddpmon.attach(ddp)
    assert "init_process_group" in str(err.value)
