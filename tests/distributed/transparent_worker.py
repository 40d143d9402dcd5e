"""One rank of the transparency job: ``python -m tests.distributed.transparent_worker CHECK``.

Every check does the same thing to a plain DDP model and to a twin with ddpmon attached, and
writes both outcomes (a value or an exception's type) to result-<rank>.json; the test
compares them. The rank ends through the interpreter's normal exit, so the exit-time paths
(the watchdog's exit record, the bounded last write) run as in a real job.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * RANK + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def twins(**ddp_options: Any) -> tuple[DDP, DDP, Any]:
    torch.manual_seed(0)
    plain = DDP(Net(), **ddp_options)
    torch.manual_seed(0)
    watched = DDP(Net(), **ddp_options)
    monitor = ddpmon.attach(watched, port=-1, job=f"transparent-{os.getpid()}", hang_timeout=0)
    return plain, watched, monitor


def train(model: nn.Module, steps: int = 3, start: int = 0) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(start, start + steps):
        x, y = data(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def weights(model: nn.Module) -> list[list[float]]:
    inner = model.module if isinstance(model, DDP) else model
    return [p.detach().flatten().tolist() for p in inner.parameters()]


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return {"ok": fn()}
    except Exception as exc:
        return {"error": type(exc).__name__}


def both(fn: Callable[[DDP], Any], **ddp_options: Any) -> dict[str, Any]:
    plain, watched, monitor = twins(**ddp_options)
    result = {
        "plain": outcome(lambda: fn(plain)),
        "watched": outcome(lambda: fn(watched)),
        "steps": monitor.snapshot()["step"],
    }
    monitor.detach()
    return result


def no_ddpmon_inside(model: nn.Module) -> bool:
    hooks = list(model._forward_pre_hooks.values()) + list(model._forward_hooks.values())
    attrs = [
        k
        for k in vars(model)
        if "ddpmon" in k or k in ("forward", "register_comm_hook", "__getstate__")
    ]
    return not attrs and not any("ddpmon" in str(getattr(h, "__module__", "")) for h in hooks)


# -- checks -----------------------------------------------------------------------------------


def check_pickle(model: DDP) -> Any:
    train(model, 2)
    copy_ = pickle.loads(pickle.dumps(model))
    return {
        "same_output": torch.equal(copy_(data(9)[0]), model(data(9)[0])),
        "clean": no_ddpmon_inside(copy_),
        "trains": len(train(copy_, 2, start=5)) == 2,
    }


def check_deepcopy(model: DDP) -> Any:
    train(model, 2)
    copy_ = copy.deepcopy(model)
    trained = train(copy_, 2, start=5)
    return {
        "same_output": torch.equal(copy_.module(data(9)[0]), copy_.module(data(9)[0])),
        "clean": no_ddpmon_inside(copy_),
        "losses": trained,
        "weights": weights(copy_),
    }


def check_torch_save(model: DDP) -> Any:
    train(model, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return {
        "weights": weights(loaded),
        "clean": no_ddpmon_inside(loaded),
        "losses": train(loaded, 2, start=5),
    }


def check_state_dict(model: DDP) -> Any:
    train(model, 2)
    state = model.state_dict()
    fresh = DDP(Net())
    fresh.load_state_dict(state)
    return {"keys": sorted(state), "weights": weights(fresh)}


def check_no_sync(model: DDP) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        with model.no_sync():
            nn.functional.mse_loss(model(data(step)[0]), data(step)[1]).backward()
        nn.functional.mse_loss(model(data(step + 10)[0]), data(step + 10)[1]).backward()
        opt.step()
    return weights(model)


def check_join(model: DDP) -> Any:
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Join([model]):
        for step in range(3 + RANK):  # uneven inputs
            opt.zero_grad()
            nn.functional.mse_loss(model(data(step)[0]), data(step)[1]).backward()
            opt.step()
    return weights(model)


def check_static_graph(model: DDP) -> Any:
    return {"losses": train(model, 4), "weights": weights(model)}


def check_comm_hook_after_attach(model: DDP) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    return {"losses": train(model, 3), "weights": weights(model)}


def check_detach(model: DDP) -> Any:
    train(model, 2)
    monitor = getattr(model, "_ddpmon_monitor", None)
    if monitor is not None:
        monitor.detach()
    return {"losses": train(model, 2, start=5), "weights": weights(model)}


def check_compile(model: DDP) -> Any:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    losses = train(compiled, 3)
    # Where Dynamo broke the graph (the reasons, each a site in DDP's code or ddpmon's) and
    # how many graphs it made; how often it re-counts one site while restarting its
    # analysis is not compared.
    breaks = sorted("".join(reason.split("\n")[:2]) for reason in counters["graph_break"])
    return {
        "losses": losses,
        "graph_breaks": breaks,
        "graphs": counters["stats"]["unique_graphs"],
        "weights": weights(model),
    }


CHECKS: dict[str, tuple[Callable[[DDP], Any], dict[str, Any]]] = {
    "pickle": (check_pickle, {}),
    "deepcopy": (check_deepcopy, {}),
    "deepcopy_find_unused": (check_deepcopy, {"find_unused_parameters": True}),
    "torch_save": (check_torch_save, {}),
    "torch_save_find_unused": (check_torch_save, {"find_unused_parameters": True}),
    "state_dict": (check_state_dict, {}),
    "no_sync": (check_no_sync, {}),
    "join": (check_join, {}),
    "static_graph": (check_static_graph, {"static_graph": True}),
    "comm_hook_after_attach": (check_comm_hook_after_attach, {}),
    "detach": (check_detach, {}),
    "compile": (check_compile, {}),
}


def main() -> None:
    names = sys.argv[1].split(",")
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD),
        rank=RANK,
        world_size=WORLD,
    )
    results = {}
    for name in names:
        fn, options = CHECKS[name]
        results[name] = both(fn, **options)
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()  # then the interpreter's own exit: atexit paths run


if __name__ == "__main__":
    main()
