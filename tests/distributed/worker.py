"""One rank of a test job: ``python -m tests.distributed.worker SCENARIO [ARGS]``.

The harness sets RANK, WORLD_SIZE, LOCAL_RANK, DDPMON_TEST_STORE (a FileStore path) and
DDPMON_TEST_OUT; each scenario returns a dict that is written to result-<rank>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}


def scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _first_bucket_follows_the_cap() -> None:
    """torch 2.2's DDP gives its first bucket ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MB)
    whatever ``bucket_cap_mb`` says, so the small models here, which ask for several buckets
    with a small cap, would have one; later torch caps the first bucket too
    (``bucket_bytes_cap_default``), and so do these jobs on torch 2.2."""
    import inspect

    if "bucket_bytes_cap_default" in inspect.getsource(DDP.__init__):
        return
    default, construct = dist._DEFAULT_FIRST_BUCKET_BYTES, DDP.__init__

    def init(self: DDP, *args: Any, bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        dist._DEFAULT_FIRST_BUCKET_BYTES = (
            int(bucket_cap_mb * 1024 * 1024) if bucket_cap_mb else default
        )
        construct(self, *args, bucket_cap_mb=bucket_cap_mb or 25, **kwargs)

    DDP.__init__ = init  # type: ignore[method-assign]


_first_bucket_follows_the_cap()


def init() -> None:
    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD)


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.hidden = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


class TwoHeads(nn.Module):
    """Rank 0 uses head_a, every other rank head_b: unused parameters differ by rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.head_a = nn.Linear(32, 8)
        self.head_b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head_a(h) if use_a else self.head_b(h)


def batch(step: int, n: int = 16, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (RANK if rank is None else rank) + step)
    return torch.randn(n, 32, generator=g), torch.randn(n, 8, generator=g)


def train(
    model: nn.Module, steps: int, opt: torch.optim.Optimizer | None = None, **fwd: Any
) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x, **fwd), y)
        loss.backward()
        opt.step()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def captured_logs() -> list[str]:
    """Every message ddpmon logs from now on, in a list."""
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(record.getMessage())

    logging.getLogger("ddpmon").addHandler(Keep())
    return logs


def registered_hooks(model: DDP) -> list[str]:
    """The names of the comm hooks DDP holds: its list of them where torch keeps one (2.2
    does not), else the one its logging data names."""
    if hasattr(model, "_comm_hooks"):
        return [getattr(h, "__name__", "?") for h, _ in model._comm_hooks]
    name = model._get_ddp_logging_data().get("comm_hook", "")
    return [name] if name else []


def read_state(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# -- scenarios ------------------------------------------------------------------------------


@scenario
def train_basic(steps: str = "8") -> dict[str, Any]:
    """Several buckets (a small bucket cap), a few steps, then every output read back."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(MLP(), bucket_cap_mb=0.01)
    mon = ddpmon.attach(model, job="basic", bucket_timing="hook")
    train(model, int(steps))
    mon.step()  # closes the last step so its buckets are folded in
    time.sleep(0.05)
    snap = mon.snapshot()
    text = scrape(mon.port)
    mon._writer.write_now()
    state = read_state(mon.state_file)
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    # The layout the c10d clock reads from DDP's logging data, for the test to compare
    # with what the comm hook saw in each GradBucket.
    from ddpmon.rank.recorder import Recorder
    from ddpmon.rank.timing.layout import BucketLayout
    from ddpmon.state.schema import Identity

    logged = Recorder(Identity(rank=0), WORLD)
    named = list(model.module.named_parameters())
    count = BucketLayout(model, [p for _, p in named], [n for n, _ in named]).refresh(logged)
    layout = [
        [b["index"], b["bytes"], b["dtype"], b["parameters"]] for b in logged.snapshot()["buckets"]
    ]
    return {
        "snapshot": snap,
        "metrics": text,
        "state": state,
        "state_file": mon.state_file,
        "port": mon.port,
        "param_bytes": sizes,
        "logged_layout": layout,
        "logged_count": count,
    }


def _grads(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.grad.flatten().tolist() for n, p in model.module.named_parameters()}


@scenario
def grads_equal(hook: str = "default", how: str = "option") -> dict[str, Any]:
    """The same model trained with and without ddpmon: gradients must be bit-identical."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ddpmon

    init()
    torch.manual_seed(0)
    plain = DDP(MLP(), bucket_cap_mb=0.01)
    torch.manual_seed(0)
    watched = DDP(MLP(), bucket_cap_mb=0.01)
    user_hook = default_hooks.fp16_compress_hook if hook == "fp16" else None
    if user_hook:
        plain.register_comm_hook(None, user_hook)
    # With a hook of the user's (given or registered later) the default times buckets: the
    # hook runs in Python anyway. DDP's own all-reduce is timed only when asked for.
    if user_hook and how == "option":
        mon = ddpmon.attach(watched, job="grads", comm_hook=user_hook)
    else:
        mon = ddpmon.attach(watched, job="grads", bucket_timing="auto" if user_hook else "hook")
        if user_hook:
            watched.register_comm_hook(None, user_hook)
    out: dict[str, Any] = {"max_diff": 0.0, "steps_compared": 0}
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.05)
    opt_w = torch.optim.SGD(watched.parameters(), lr=0.05)
    for step in range(5):
        x, y = batch(step)
        for model, opt in ((plain, opt_p), (watched, opt_w)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        gp, gw = _grads(plain), _grads(watched)
        diff = max(max(abs(a - b) for a, b in zip(gp[n], gw[n])) for n in gp)
        out["max_diff"] = max(out["max_diff"], diff)
        out["steps_compared"] += 1
        opt_p.step()
        opt_w.step()
    mon.step()
    snap = mon.snapshot()
    out["bucket_counts"] = [b["count"] for b in snap["buckets"]]
    out["mode"] = snap["bucket_timing"]
    out["dtypes"] = [b["dtype"] for b in snap["buckets"]]
    if how == "after_attach" and user_hook:
        try:
            watched.register_comm_hook(None, user_hook)
            out["second_register"] = "accepted"
        except RuntimeError as exc:
            out["second_register"] = str(exc)
    return out


@scenario
def unused_by_rank() -> dict[str, Any]:
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=True)
    mon = ddpmon.attach(model, job="unused")
    train(model, 4, use_a=(RANK == 0))
    mon.step()
    text = scrape(mon.port)
    mon._writer.write_now()
    return {"snapshot": mon.snapshot(), "metrics": text, "state": read_state(mon.state_file)}


@scenario
def reduction_error() -> dict[str, Any]:
    """find_unused_parameters=False with an unused head: DDP raises at the next forward."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(TwoHeads())
    ddpmon.attach(model, job="reduction")
    try:
        train(model, 3, use_a=True)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


@scenario
def bad_inputs() -> dict[str, Any]:
    import socket

    import ddpmon

    init()
    out: dict[str, Any] = {}
    try:
        ddpmon.attach(MLP())
    except ddpmon.AttachError as exc:
        out["not_ddp"] = str(exc)
    model = DDP(MLP())
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    busy = blocker.getsockname()[1]
    logs = captured_logs()
    # base + LOCAL_RANK lands on the port this rank holds
    mon = ddpmon.attach(
        model, job="bad", port=busy - RANK, bind="127.0.0.1", state_dir="/proc/ddpmon-cannot-write"
    )
    try:
        ddpmon.attach(model)
    except ddpmon.AttachError as exc:
        out["twice"] = str(exc)
    train(model, 3)
    out["busy_port"] = busy
    out["bound_port"] = mon.port
    out["state_file"] = mon.state_file
    out["logs"] = logs
    out["steps"] = mon.snapshot()["step"]
    try:
        ddpmon.attach(DDP(MLP()), hang_timeout="soon")
    except ddpmon.ConfigError as exc:
        out["bad_option"] = str(exc)
    try:
        ddpmon.attach(DDP(MLP()), colour="blue")
    except ddpmon.ConfigError as exc:
        out["unknown_option"] = str(exc)
    spare = DDP(MLP())
    try:
        ddpmon.attach(spare, port=65535).detach()  # + LOCAL_RANK 1 is past the last port on rank 1
        out["port_past_range"] = "accepted"
    except ddpmon.ConfigError as exc:
        out["port_past_range"] = str(exc)
    try:
        ddpmon.attach(spare, comm_hook=lambda x: x)
    except ddpmon.ConfigError as exc:
        out["bad_hook"] = str(exc)
    try:
        ddpmon.attach(DDP(MLP()), bucket_timing="c10d")
    except ddpmon.ConfigError as exc:
        out["c10d_on_gloo"] = str(exc)
    out["spare_clean"] = (
        len(spare._forward_pre_hooks),
        "forward" in spare.__dict__,
        getattr(spare, "_ddpmon_monitor", None),
    )
    # auto on gloo: a hook registered after attach is timed, also after DDP refused a first one
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with ddpmon.attach(spare, job="later", port=-1) as later:
        try:
            spare.register_comm_hook(None, lambda x: x)
        except Exception as exc:
            out["later_refused"] = type(exc).__name__
        out["later_modes"] = [later.snapshot()["bucket_timing"]]
        spare.register_comm_hook(None, default_hooks.allreduce_hook)
        train(spare, 2)
        later.step()
        out["later_modes"].append(later.snapshot()["bucket_timing"])
        out["later_counts"] = [b["count"] for b in later.snapshot()["buckets"]]
    # bucket_timing=off where buckets complete on the GPU (NCCL, stood in for): no comm hook
    from ddpmon.rank.timing import c10d as completion

    real_backend_name = completion.backend_name
    completion.backend_name = lambda group, device="cpu": "nccl"  # type: ignore[assignment]
    try:
        off_model = DDP(MLP())
        with ddpmon.attach(off_model, job="off", port=-1, bucket_timing="off"):
            out["off_hooks"] = [
                getattr(off_model, "_ddpmon_comm_hook", None) is not None,
                off_model._get_ddp_logging_data().get("comm_hook", ""),
            ]
    finally:
        completion.backend_name = real_backend_name
    second = DDP(MLP())
    try:  # the first model's monitor (job "bad") has state files off; use a shared one
        first = ddpmon.attach(DDP(MLP()), job="pair")
        ddpmon.attach(second, job="pair")
    except ddpmon.AttachError as exc:
        out["same_state_file"] = str(exc)
    other_dir = os.path.join(os.environ["DDPMON_TEST_OUT"], "state-2")
    second_monitor = ddpmon.attach(second, job="pair", state_dir=other_dir)
    out["second_state_file"] = second_monitor.state_file == os.path.join(
        other_dir, f"rank-{RANK}.json"
    )
    second_monitor.detach()
    first.detach()
    import ddpmon.rank.monitor

    def failing(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("injected: attach fails part-way")

    fresh = DDP(MLP())
    real = ddpmon.rank.monitor.StepHooks
    ddpmon.rank.monitor.StepHooks = failing  # after the comm hook is in place, before the rest
    try:
        ddpmon.attach(fresh, job="rollback", bucket_timing="hook")
    except RuntimeError as exc:
        out["partway"] = str(exc)
    finally:
        ddpmon.rank.monitor.StepHooks = real
    # ddpmon's comm hook stays registered with DDP (it cannot be removed), as a pass-through
    out["partway_clean"] = (
        fresh._ddpmon_comm_hook.timing,
        len(fresh._forward_pre_hooks),
        "forward" in fresh.__dict__,
        getattr(fresh, "_ddpmon_monitor", None),
    )
    train(fresh, 2)  # the model still trains
    mon_again = ddpmon.attach(fresh, job="rollback")  # and ddpmon attaches once the cause is gone
    train(fresh, 2)
    mon_again.step()
    out["partway_reattached_steps"] = mon_again.snapshot()["step"]
    mon_again.detach()
    return out


@scenario
def hook_failure() -> dict[str, Any]:
    """A failure inside ddpmon's comm hook: logged once, that part off, training unharmed."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(MLP())
    mon = ddpmon.attach(model, job="failure", bucket_timing="hook")
    logs = captured_logs()

    def broken(*_a: Any, **_k: Any) -> None:
        raise ValueError("injected failure")

    mon.recorder.set_bucket_layout = broken  # type: ignore[method-assign]
    mon.recorder.bucket_launched = broken  # type: ignore[method-assign]
    train(model, 4)
    mon.step()
    snap = mon.snapshot()
    return {
        "steps": snap["step"],
        "errors": snap["errors"],
        "logs": logs,
        "metrics": scrape(mon.port),
    }


@scenario
def detach_and_reattach() -> dict[str, Any]:
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(MLP())
    with ddpmon.attach(model, job="detach", bucket_timing="hook") as mon:
        train(model, 3)
        port = mon.port
    out: dict[str, Any] = {"steps_first": mon.snapshot()["step"]}
    train(model, 3)  # after detach: nothing is recorded any more
    out["steps_after_detach"] = mon.snapshot()["step"]
    out["forward_restored"] = "forward" not in model.__dict__
    try:
        scrape(port)
        out["endpoint_closed"] = False
    except OSError:
        out["endpoint_closed"] = True
    mon2 = ddpmon.attach(model, job="detach")  # auto: DDP holds ddpmon's hook, which times
    train(model, 3)
    mon2.step()
    out["steps_second"] = mon2.snapshot()["step"]
    out["second_buckets"] = [b["count"] for b in mon2.snapshot()["buckets"]]
    out["second_mode"] = mon2.snapshot()["bucket_timing"]
    mon2.detach()
    return out


def accumulate(model: DDP, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` optimizer steps of 3 micro-steps each, the first 2 under no_sync."""
    for step in range(steps):
        for micro in range(3):
            x, y = batch(10 * step + micro)
            if micro < 2:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@scenario
def no_sync_accumulation() -> dict[str, Any]:
    """Gradient accumulation: microbatches under no_sync fold into one step."""
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(MLP())
    mon = ddpmon.attach(model, job="accum")
    accumulate(model, torch.optim.SGD(model.parameters(), lr=0.01), 4)
    mon.step()
    return {"snapshot": mon.snapshot()}


@scenario
def cuda_timing(backend: str = "gloo", timing: str = "auto") -> dict[str, Any]:
    """CUDA tensors, bucket timing from CUDA events (the hook) or from c10d (NCCL);
    gradients compared with an unwatched twin."""
    import ddpmon

    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD)
    dist.init_process_group(backend, store=store, rank=RANK, world_size=WORLD)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    kwargs = {"device_ids": [0]} if backend == "nccl" else {}
    torch.manual_seed(0)
    plain = DDP(MLP(width=256).to(device), bucket_cap_mb=0.1, **kwargs)
    torch.manual_seed(0)
    watched = DDP(MLP(width=256).to(device), bucket_cap_mb=0.1, **kwargs)
    mon = ddpmon.attach(watched, job="cuda", bucket_timing=timing)
    max_diff = 0.0
    for step in range(20):
        x, y = (t.to(device) for t in batch(step))
        for model in (plain, watched):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        for (_, a), (_, b) in zip(
            plain.module.named_parameters(), watched.module.named_parameters()
        ):
            max_diff = max(max_diff, (a.grad - b.grad).abs().max().item())
    torch.cuda.synchronize()
    # c10d reports completions from its watchdog thread, a little later; the flight recorder
    # is read every POLL_SECONDS
    from ddpmon.rank.timing import flight

    time.sleep(flight.POLL_SECONDS + 1.0 if timing == "flight_recorder" else 1.0)
    mon.step()  # events are complete after the synchronize: this boundary resolves them
    snap = mon.snapshot()
    mon.detach()
    exposed = snap["timings"]["exposed_comm_seconds"]
    return {
        "max_diff": max_diff,
        "steps": snap["step"],
        "buckets": snap["buckets"],
        "exposed_median": exposed["median"] if exposed else None,
        "mode": snap["bucket_timing"],
        "comm_hooks": len(getattr(watched, "_comm_hooks", [])),
        "notes": snap["notes"],
    }


@scenario
def cuda_exit_without_destroy() -> dict[str, Any]:
    """NCCL with c10d timing, and a program that never calls destroy_process_group: c10d's
    hook thread must not outlive the interpreter (ddpmon destroys the group at exit). The
    process ends through normal interpreter exit, and must end with status 0."""
    import ddpmon

    store = dist.FileStore(os.environ["DDPMON_TEST_STORE"], WORLD)
    dist.init_process_group("nccl", store=store, rank=RANK, world_size=WORLD)
    torch.cuda.set_device(0)
    model = DDP(MLP(width=256).cuda(), device_ids=[0], bucket_cap_mb=0.1)
    mon = ddpmon.attach(model, job="exit")
    for step in range(10):
        x, y = (t.cuda() for t in batch(step))
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
    result = {"mode": mon.snapshot()["bucket_timing"]}
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)  # no detach, no destroy_process_group: collectives may still be completing


@scenario
def without_bucket_timing(timing: str = "auto") -> dict[str, Any]:
    """bucket_timing off (and auto on gloo, which has no cheap timing source): DDP's own
    all-reduce stays in place; steps, phases and exposed communication still work, and a
    hook registered after detach is DDP's own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ddpmon

    init()
    torch.manual_seed(0)
    plain = DDP(MLP())
    torch.manual_seed(0)
    watched = DDP(MLP())
    mon = ddpmon.attach(watched, job="untimed", bucket_timing=timing)
    builtin_hook = watched._get_ddp_logging_data().get("comm_hook", "")
    # What the gradients hold when ddpmon hears that DDP has synchronised them: the c10d
    # clock records its "collectives done" CUDA event at this moment.
    first = next(watched.module.parameters())
    at_sync: list[torch.Tensor] = []
    heard = mon.recorder.gradients_synced

    def spy(now: float | None = None) -> None:
        at_sync.append(first.grad.clone())
        heard(now)

    mon.recorder.gradients_synced = spy  # type: ignore[method-assign]
    max_diff = 0.0
    phases, synced_after_ddp = [], []
    for step in range(4):
        x, y = batch(step)
        for model in (plain, watched):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        phases.append(mon.snapshot()["stage"])
        # Before DDP's finalize the gradient is this rank's own; after it, the average.
        synced_after_ddp.append(len(at_sync) == step + 1 and torch.equal(at_sync[-1], first.grad))
        g1, g2 = _grads(plain), _grads(watched)
        max_diff = max(max_diff, max(max(abs(a - b) for a, b in zip(g1[n], g2[n])) for n in g1))
    metrics = scrape(mon.port)  # three steps closed: the fourth ends at the next forward
    mon.detach()  # ... or here: it synchronised its gradients, so it counts
    snap = mon.snapshot()
    watched.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own: nothing in the way
    return {
        "max_diff": max_diff,
        "steps": snap["step"],
        "buckets": snap["buckets"],
        "backward": snap["timings"]["backward_seconds"],
        "metrics": metrics,
        "registered": registered_hooks(watched),
        "phases": phases,
        "mode": snap["bucket_timing"],
        "synced_after_ddp": synced_after_ddp,
        "exposed": snap["timings"]["exposed_comm_seconds"],
        "comm_hook_at_attach": builtin_hook,
    }


@scenario
def flight_recorder_timing() -> dict[str, Any]:
    """bucket_timing='flight_recorder' on gloo: ddpmon reads torch's real flight recorder,
    finds DDP's all-reduces there without a duration, and turns the source off, saying why,
    while training goes on with gradients as without ddpmon."""
    import ddpmon
    from ddpmon.rank.timing import flight

    flight.POLL_SECONDS = 0.5  # (5 s by default) so that a few seconds of steps are read
    init()
    torch.manual_seed(0)
    plain = DDP(MLP(), bucket_cap_mb=0.01)
    torch.manual_seed(0)
    watched = DDP(MLP(), bucket_cap_mb=0.01)
    logs = captured_logs()
    mon = ddpmon.attach(watched, job="flight", port=0, bucket_timing="flight_recorder")
    modes, max_diff = [mon.snapshot()["bucket_timing"]], 0.0
    steps = 80  # 2.4 s at least: the recorder is read every half second
    for step in range(steps):
        x, y = batch(step)
        for model in (plain, watched):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        g1, g2 = _grads(plain), _grads(watched)
        max_diff = max(max_diff, max(max(abs(a - b) for a, b in zip(g1[n], g2[n])) for n in g1))
        time.sleep(0.03)
    snap = mon.snapshot()
    metrics = scrape(mon.port)
    mon.detach()
    return {
        "modes": modes + [snap["bucket_timing"]],
        "steps": steps,
        "notes": snap["notes"],
        "buckets": len(snap["buckets"]),
        "max_diff": max_diff,
        "info": [line for line in metrics.splitlines() if line.startswith("ddpmon_rank_info{")],
        "off_lines": [line for line in logs if "timing from flight_recorder is off" in line],
    }


@scenario
def c10d_wiring() -> dict[str, Any]:
    """The c10d clock's wiring in a real DDP job. gloo has no completion hook, so c10d's
    stream of completions is replayed: a comm hook registered after attach (DDP's own
    register_comm_hook, as in c10d mode) sends what ProcessGroupNCCL would, a WorkInfo-shaped
    record per all-reduce from the thread that completes it, to ddpmon's listener."""
    import datetime
    import types

    import ddpmon
    from ddpmon.rank.timing import c10d as completion

    init()
    listeners: list[Any] = []
    completion.unavailable_reason = lambda group, device="cpu": None  # type: ignore[assignment]
    completion.listen = lambda group, fn: listeners.append(fn) or (lambda: listeners.remove(fn))  # type: ignore[assignment]
    completion.SETTLE_SECONDS = 0.5
    torch.manual_seed(0)
    model = DDP(MLP(), bucket_cap_mb=0.01)
    mon = ddpmon.attach(model, job="c10d")
    seq = [0]

    def replay(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks real annotations)
        tensor = bucket.buffer().mul_(1.0 / WORLD)
        seq[0] += 1
        record = types.SimpleNamespace(
            op_type=torch._C._distributed_c10d.OpType.ALLREDUCE,
            seq=seq[0],
            time_started=datetime.datetime.now(),
        )
        start = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            record.active_duration = datetime.timedelta(seconds=time.perf_counter() - start)
            for fn in listeners:
                fn(record)
            return fut.value()[0]

        return dist.group.WORLD.allreduce([tensor]).get_future().then(done)

    model.register_comm_hook(None, replay)
    train(model, 8)
    time.sleep(0.6)
    mon.step()
    snap = mon.snapshot()
    metrics = scrape(mon.port)
    mon.detach()
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    return {
        "metrics": metrics,
        "mode": snap["bucket_timing"],
        "buckets": snap["buckets"],
        "steps": snap["step"],
        "param_bytes": sizes,
        "listeners_left": len(listeners),
        "notes": snap["notes"],
        "exposed": snap["timings"]["exposed_comm_seconds"],
        "phase_counts": snap["collectives"],
    }


@scenario
def subgroup() -> dict[str, Any]:
    """DDP on a subgroup (each rank its own group here, as in HSDP's replicas): the state
    file keeps the job's world size, DDP's group size beside it."""
    import ddpmon

    init()
    groups = [dist.new_group([r]) for r in range(WORLD)]
    torch.manual_seed(0)
    model = DDP(MLP(), process_group=groups[RANK])
    mon = ddpmon.attach(model, job="subgroup", bucket_timing="hook")
    train(model, 3)
    mon.step()
    snap = mon.snapshot()
    return {
        "world_size": snap["world_size"],
        "ddp_world_size": snap["ddp_world_size"],
        "rank": snap["rank"],
        "steps": snap["step"],
        "buckets": len(snap["buckets"]),
    }


class AuxFirst(nn.Module):
    """Returns (auxiliary output, main output); the loss uses only the second."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.aux = nn.Linear(32, 8)
        self.main = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.aux(h), self.main(h)


@scenario
def backward_from_second_output() -> dict[str, Any]:
    import ddpmon

    init()
    torch.manual_seed(0)
    model = DDP(AuxFirst(), find_unused_parameters=True)
    mon = ddpmon.attach(model, job="aux", bucket_timing=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x)[1], y).backward()
        opt.step()
    mon.step()
    snap = mon.snapshot()
    return {"backward": snap["timings"]["backward_seconds"], "unused": snap["unused_parameters"]}


@scenario
def dataclass_output() -> dict[str, Any]:
    """A model returning a dataclass, with no comm hook in the way (bucket_timing off, as for
    c10d): the start of backward is found on the dataclass's tensor, so steps are counted."""
    import dataclasses

    import ddpmon

    @dataclasses.dataclass
    class Output:
        prediction: torch.Tensor
        note: str = "dataclass"

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = MLP()

        def forward(self, x: torch.Tensor) -> Output:
            return Output(self.body(x))

    init()
    model = DDP(Wrapped())
    mon = ddpmon.attach(model, job="dataclass", bucket_timing="off")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x).prediction, y).backward()
        opt.step()
    steps_seen = mon.snapshot()["step"]  # five, each closed at its optimizer step
    mon.detach()  # nothing left to count
    snap = mon.snapshot()
    return {
        "before_detach": steps_seen,
        "steps": snap["step"],
        "backward": snap["timings"]["backward_seconds"],
    }


def main() -> None:
    name, args = sys.argv[1], sys.argv[2:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + str(RANK) + " %(message)s")
    finish(SCENARIOS[name](*args))


def finish(result: dict[str, Any]) -> None:
    """Write this rank's result for the harness, leave the group with the others, exit."""
    with open(os.path.join(os.environ["DDPMON_TEST_OUT"], f"result-{RANK}.json"), "w") as f:
        json.dump(result, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Skip interpreter finalization: a gloo rank whose worker threads still hold futures with
    # Python callbacks can abort there ("terminate called without an active exception"; seen
    # once in about 50 runs of these scenarios on torch 2.13). The results are already written.
    os._exit(0)


if __name__ == "__main__":
    main()
