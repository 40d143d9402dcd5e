"""Each private torch API ddpmon relies on (ddpmon/rank/torch_api.py), removed in turn as a
future release might: the part that needs it switches itself off with one warning line, the
training goes on, and the other parts keep working.

Real one-rank DDP jobs (gloo, a FileStore) in this process, a few steps each. torch's own
objects are patched here and put back after each test.
"""

from __future__ import annotations

import logging
import re
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.variable import Variable
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpmon
from ddpmon.rank import flight_recorder, torch_api
from ddpmon.rank.hooks.collectives import group_identity
from ddpmon.rank.timing import c10d
from ddpmon.state import root
from tests.support.in_process import STEPS, train
from tests.support.torch_features import COMPILE_CHECK

pytestmark = pytest.mark.timeout(120)

RANK_WING = Path(ddpmon.__file__).resolve().parent / "rank"
PRIVATE = re.compile(
    r"\._(get_ddp_logging_data|check_comm_hook|comm_hooks|execution_engine|register_on_completion_hook"
    r"|enable_collectives_timing|get_backend|get_process_group_name|get_default_store|dump_fr_trace"
    r"|dump_nccl_trace|dynamo|C|orig_mod|profiler_enabled|is_profiler_enabled|backward_hooks"
    r"|register_hook_dict)\b"
)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says its line anew."""
    monkeypatch.setattr(torch_api, "_said", set())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        self.head = nn.Linear(32, 8)
        self.spare = nn.Linear(32, 8)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def attached(tmp_path: Path, **options: Any) -> tuple[DDP, Any]:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001, find_unused_parameters=True)
    return model, ddpmon.attach(
        model, job="api", port=-1, state_dir=str(tmp_path / "state"), **options
    )


ABSENT_HERE = () if COMPILE_CHECK else ("torch.compiler.is_compiling",)
"""What this torch lacks without any test removing it."""


def off_lines(caplog: pytest.LogCaptureFixture, api: str = " off: torch ") -> list[str]:
    """The warnings that name ``api``; by default every part switched off for a missing API
    but those this torch lacks anyway."""
    return [
        m
        for m in (r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
        if api in m and not any(f"has no {absent};" in m for absent in ABSENT_HERE if absent != api)
    ]


def line(part: str, api: str) -> str:
    return f"ddpmon: rank 0: {part} off: torch {torch.__version__} has no {api}; training goes on"


def check_the_rest(snap: dict[str, Any], backward: bool = True) -> None:
    """What does not need the removed API still works: steps, their parts, unused parameters."""
    assert snap["step"] == STEPS, "training goes on, every step counted"
    assert (
        snap["timings"]["window_steps"] == STEPS and snap["timings"]["forward_seconds"]["max"] > 0
    )
    assert (snap["timings"]["backward_seconds"]["max"] > 0) is backward
    assert snap["unused_parameters"] == ["spare.weight", "spare.bias"]
    assert not snap["errors"], snap["errors"]


def test_nothing_in_the_rank_wing_but_torch_api_names_a_private_torch_api() -> None:
    uses = [
        f"{path.relative_to(RANK_WING.parent)}:{n}: {text.strip()}"
        for path in sorted(RANK_WING.rglob("*.py"))
        if path.name != "torch_api.py"
        for n, text in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(text.split("#")[0]) and "``" not in text
    ]
    assert not uses, uses


# -- Tensor._backward_hooks, Node._register_hook_dict -------------------------------------


def test_the_outputs_hook_fires_once_beside_the_programs_own() -> None:
    """``hook_tensor`` does what ``register_hook`` does for a fresh output, without the
    handle: the hook fires once per backward with the output's gradient, a hook the program
    registers afterwards fires too, and one registered before is kept (``register_hook``)."""
    weight = torch.randn(4, 4, requires_grad=True)
    seen: list[str] = []
    for before in (False, True):
        seen.clear()
        out = torch.randn(2, 4) @ weight
        if before:
            out.register_hook(lambda g: seen.append("before"))
        torch_api.hook_tensor(out, lambda g: seen.append(f"ddpmon {tuple(g.shape)}"))
        if not before:  # its own dict on a fresh output, no handle
            assert list(out._backward_hooks) == ["ddpmon"]
        out.register_hook(lambda g: seen.append("after"))
        out.sum().backward()
        assert seen == ["before"] * before + ["ddpmon (2, 4)", "after"]
    leaf = torch.randn(3, requires_grad=True)  # no grad_fn: register_hook's way
    torch_api.hook_tensor(leaf, lambda g: seen.append("leaf"))
    (leaf * 2).sum().backward()
    assert seen[-1] == "leaf"


# -- DistributedDataParallel._get_ddp_logging_data -----------------------------------------

LOGGING_DATA = "DistributedDataParallel._get_ddp_logging_data"


@pytest.mark.parametrize("timing", ["auto", "hook"])
def test_without_ddp_logging_data(
    group: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    timing: str,
) -> None:
    monkeypatch.delattr(DDP, "_get_ddp_logging_data")
    model, mon = attached(tmp_path, bucket_timing=timing)
    train(model)
    mon.step()
    snap = mon.snapshot()
    mon.detach()
    expected = line(torch_api.LOGGING_DATA, LOGGING_DATA)
    assert off_lines(caplog, LOGGING_DATA) == [expected]
    assert expected.removeprefix("ddpmon: rank 0: ").removesuffix("; training goes on") in snap[
        "notes"
    ]["torch_api"].split("\n")
    assert snap["ddp"] == {}
    check_the_rest(snap)
    if timing == "hook":  # a comm hook shows the buckets: they are timed as ever
        assert snap["buckets"] and all(b["count"] == STEPS for b in snap["buckets"])
    else:
        assert snap["buckets"] == []


def without_c10d(monkeypatch: pytest.MonkeyPatch, api: str) -> dict[str, Any]:
    """On NCCL (stood in for), with ``api`` gone: ``bucket_timing='c10d'`` is refused at
    attach, naming it, and ``auto`` trains without c10d timing; the snapshot."""
    monkeypatch.setattr(c10d, "backend_name", lambda group, device="cpu": "nccl")
    torch.manual_seed(0)
    model = DDP(Net(), find_unused_parameters=True)
    with pytest.raises(ddpmon.ConfigError, match=re.escape(f"has no {api}")):
        ddpmon.attach(model, port=-1, state_dir=None, bucket_timing="c10d")
    mon = ddpmon.attach(model, port=-1, state_dir=None)
    train(model)
    mon.step()
    snap = mon.snapshot()
    mon.detach()
    assert snap["bucket_timing"] == "off"
    return snap


def test_c10d_timing_needs_ddp_logging_data(
    group: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """c10d's timings are matched to DDP's bucket layout: without it there is no c10d timing."""
    monkeypatch.delattr(DDP, "_get_ddp_logging_data")
    snap = without_c10d(monkeypatch, LOGGING_DATA)
    assert off_lines(caplog, LOGGING_DATA) == [line(torch_api.LOGGING_DATA, LOGGING_DATA)]
    check_the_rest(snap)


# -- DistributedDataParallel._check_comm_hook ----------------------------------------------

CHECK = "DistributedDataParallel._check_comm_hook"


def test_without_check_comm_hook(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook given to attach and one registered after it run unchecked, inside ddpmon's
    timing hook, and are timed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls: list[int] = []

    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    def register_unchecked(self: DDP, state: object, hook: Any) -> None:
        """DDP's register_comm_hook as a torch without _check_comm_hook would have it."""
        self.logger._set_comm_hook_name(hook.__qualname__)
        if hasattr(self, "_comm_hooks"):  # (torch 2.2 keeps none)
            self._comm_hooks.append((hook, state))
        dist._register_comm_hook(self.reducer, state, hook)

    monkeypatch.delattr(DDP, "_check_comm_hook")
    monkeypatch.setattr(DDP, "register_comm_hook", register_unchecked)
    model, mon = attached(tmp_path, comm_hook=default_hooks.allreduce_hook)
    train(model, 2)
    model2, mon2 = attached(tmp_path / "later")
    model2.register_comm_hook(None, counted)
    train(model2)
    mon2.step()
    snap = mon2.snapshot()
    mon.detach()
    mon2.detach()
    part = "checking a comm hook before ddpmon runs it (a bad one fails at its first bucket)"
    assert off_lines(caplog, CHECK) == [line(part, CHECK)]
    assert mon.snapshot()["bucket_timing"] == "hook" and snap["bucket_timing"] == "hook"
    assert calls and snap["buckets"] and all(b["count"] == STEPS for b in snap["buckets"])
    check_the_rest(snap)


# -- DistributedDataParallel._comm_hooks ---------------------------------------------------


def test_without_the_list_of_comm_hooks(
    group: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing is off: a hook registered before attach is still found (DDP's logging data
    names it), and a copy of an attached model is still a plain one."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    before = DDP(Net(), find_unused_parameters=True)
    before.register_comm_hook(None, default_hooks.allreduce_hook)
    before.__dict__.pop("_comm_hooks", None)  # (torch 2.2 has none)
    with pytest.raises(ddpmon.AttachError, match="already has a comm hook"):
        ddpmon.attach(before, port=-1, state_dir=None)
    model, mon = attached(tmp_path, bucket_timing="off")
    model.__dict__.pop("_comm_hooks", None)
    train(model)
    twin = copy.deepcopy(model)
    mon.detach()
    assert not hasattr(twin, "_ddpmon_monitor") and not twin._forward_hooks
    assert not off_lines(caplog)
    check_the_rest(mon.snapshot())


# -- torch.autograd.Variable._execution_engine.queue_callback ------------------------------

QUEUE = "torch.autograd.Variable._execution_engine.queue_callback"


class EngineWithoutQueue:
    """autograd's engine as a torch without ``queue_callback`` would have it."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "queue_callback":
            raise AttributeError(name)
        return getattr(self._engine, name)


@pytest.mark.parametrize("removed", ["queue_callback", "_execution_engine"])
def test_without_queue_callback(
    group: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    removed: str,
) -> None:
    """Backward is not timed; steps end at their optimizer step, and bucket timing (through
    the comm hook) and unused parameters go on."""
    monkeypatch.delattr(torch.autograd.graph, "queue_callback", raising=False)  # public from 2.15
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001, find_unused_parameters=True)
    if removed == "queue_callback":
        monkeypatch.setattr(
            Variable, "_execution_engine", EngineWithoutQueue(Variable._execution_engine)
        )
    else:  # autograd's own backward needs the engine: only ddpmon's view of it goes
        stand_in = type("Variable", (), {"_execution_engine": Variable._execution_engine})
        for module in (torch.autograd, torch.autograd.graph):  # where autograd looks it up
            monkeypatch.setattr(module, "Variable", stand_in, raising=False)
        monkeypatch.delattr(Variable, "_execution_engine")
    mon = ddpmon.attach(
        model, job="api", port=-1, state_dir=str(tmp_path / "state"), bucket_timing="hook"
    )
    train(model)
    snap = mon.snapshot()
    mon.detach()
    assert off_lines(caplog, QUEUE) == [line(torch_api.BACKWARD_MARKS, QUEUE)]
    check_the_rest(snap, backward=False)
    assert snap["buckets"] and all(b["count"] == STEPS for b in snap["buckets"])


# -- torch.compiler.is_compiling ----------------------------------------------------------


def test_without_a_compile_check(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As on torch 2.2: compiled models are not watched well, said once; uncompiled models
    are watched as ever."""
    from ddpmon.rank.hooks import step

    with monkeypatch.context() as without:  # torch's own modules call it: hidden from ddpmon alone
        without.setattr(
            torch_api,
            "torch",
            types.SimpleNamespace(compiler=types.SimpleNamespace(), __version__=torch.__version__),
        )
        check, missing = step._compile_check()
    assert missing is not None and check() is False
    monkeypatch.setattr(step, "is_compiling", check)
    monkeypatch.setattr(step, "_compile_check_missing", missing)
    model, mon = attached(tmp_path)
    train(model)
    snap = mon.snapshot()
    mon.detach()
    api = "torch.compiler.is_compiling"
    assert off_lines(caplog, api) == [line(torch_api.COMPILE, api)]
    check_the_rest(snap)


# -- ProcessGroup._register_on_completion_hook, _enable_collectives_timing -----------------


@pytest.mark.parametrize("name", ["_register_on_completion_hook", "_enable_collectives_timing"])
def test_without_the_completion_hook(
    group: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.delattr(dist.ProcessGroup, name)
    snap = without_c10d(monkeypatch, f"ProcessGroup.{name}")
    assert off_lines(caplog, f"ProcessGroup.{name}") == [
        line("c10d bucket timing", f"ProcessGroup.{name}")
    ]
    check_the_rest(snap)


# -- ProcessGroup._get_backend -------------------------------------------------------------


def test_without_get_backend(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing is off: torch.distributed.get_backend names the group's backend."""
    model, mon = attached(tmp_path)  # DDP's own constructor asks for the backend
    monkeypatch.delattr(dist.ProcessGroup, "_get_backend")
    assert c10d.backend_name(model.process_group) == "gloo"
    assert (
        c10d.unavailable_reason(model.process_group)
        == "the gloo backend has no completion hook (only NCCL has one)"
    )
    train(model)
    mon.step()
    snap = mon.snapshot()
    mon.detach()
    assert not off_lines(caplog)
    check_the_rest(snap)


# -- distributed_c10d._get_process_group_name ----------------------------------------------

NAME = "distributed_c10d._get_process_group_name"


def test_without_process_group_names(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where groups have no ``group_name`` either, every group's collectives are numbered as
    one group, ``?``; collective tracking and the rest go on."""
    model, mon = attached(tmp_path)
    assert group_identity(None) == (dist.group.WORLD.group_name, 1)
    monkeypatch.delattr(dist.distributed_c10d, "_get_process_group_name")
    assert group_identity(None) == (dist.group.WORLD.group_name, 1), "group_name is enough"
    assert not off_lines(caplog, NAME)
    monkeypatch.delattr(dist.ProcessGroup, "group_name")
    mon._collectives._groups.clear()
    train(model)
    dist.all_reduce(torch.ones(4))
    dist.barrier()
    mon.step()
    snap = mon.snapshot()
    mon.detach()
    part = "process group names (the collectives of every group are numbered as one group, '?')"
    assert off_lines(caplog, NAME) == [
        f"ddpmon: rank 0: {part} off: torch {torch.__version__} has no {NAME}; training goes on"
    ]
    assert {c["op"]: c["group"] for c in snap["collective_log"] if c["bucket"] is None} == {
        "all_reduce": "?",
        "barrier": "?",
    }
    check_the_rest(snap)


# -- distributed_c10d._get_default_store (state/root.py) -----------------------------------


def test_without_the_default_store(
    group: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The launch id (the default job name) comes from the launcher process instead."""
    monkeypatch.setattr(root, "_launch_id", None)
    agreed = root.launch_id()
    assert dist.distributed_c10d._get_default_store().get(root._LAUNCH_KEY).decode() == agreed
    monkeypatch.setattr(root, "_launch_id", None)
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    assert root.launch_id() == root._launch_id_from_parent()
    assert root.launch_id() == root._launch_id_from_parent()
    api = "distributed_c10d._get_default_store"
    assert off_lines(caplog, api) == [
        "ddpmon: rank 0: one job name through the job's store off (each node names the job from its launcher "
        f"process; pass job= to name it): torch {torch.__version__} has no {api}; training goes on"
    ]


# -- the flight recorder's dump ------------------------------------------------------------


def test_without_the_flight_recorder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Hang reports say why they hold no flight recorder entries; said once in the log."""
    from torch._C import _distributed_c10d as torch_c10d

    for name in torch_api.FLIGHT_RECORDER_DUMPS:
        monkeypatch.delattr(torch_c10d, name, raising=False)
    api = "torch._C._distributed_c10d._dump_fr_trace_json (nor _dump_fr_trace)"
    text = f"the flight recorder in hang reports off: torch {torch.__version__} has no {api}"
    assert flight_recorder.read() == {"flight_recorder_error": text}
    assert flight_recorder.read() == {"flight_recorder_error": text}
    assert off_lines(caplog, api) == [f"ddpmon: {text}; training goes on"]
