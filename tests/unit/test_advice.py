"""The advice checks that need what this machine lacks (GPUs, several hosts) or states a real
job would not reach quickly: device mapping with fakes of what torch reports, the cross-rank
comparisons over hand-made states, and the doctor's rank_as_device rule over state files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpmon
from ddpmon.advice import KINDS, compare
from ddpmon.doctor import examine
from ddpmon.rank.advice import cadence, data, replicas
from ddpmon.rank.advice.devices import DeviceFacts, check
from ddpmon.rank.advice.readback import crc, sample
from ddpmon.rank.recorder import Recorder
from ddpmon.state import schema
from tests.support import states

ROOT = Path(__file__).resolve().parents[2]


# -- device mapping (fakes of torch.cuda's answers) ---------------------------------------------


@pytest.mark.parametrize(
    "facts, cause",
    [
        (DeviceFacts("cuda:0", 1, 1, 8, 0), "set_device(local_rank) missing"),
        (DeviceFacts("cuda:9", 9, 1, 16, 9), "the global rank used as device index"),
        (DeviceFacts("cuda:3", 1, 1, 8, 3), "a device index that is not LOCAL_RANK"),
    ],
)
def test_device_index_that_is_not_local_rank(facts: DeviceFacts, cause: str) -> None:
    found = check(facts)
    assert found is not None and found.kind == "device_mismatch"
    assert cause in found.summary and f"LOCAL_RANK is {facts.local_rank}" in found.summary
    assert "set_device" in found.fix


def test_model_on_its_gpu_but_another_current_device() -> None:
    found = check(DeviceFacts("cuda:1", 1, 1, 2, 0))
    assert found is not None and "current CUDA device is cuda:0" in found.summary


@pytest.mark.parametrize(
    "facts",
    [
        DeviceFacts("cuda:1", 1, 1, 2, 1),  # right
        DeviceFacts("cuda:0", 3, 1, 1, 0),  # one GPU per process (CUDA_VISIBLE_DEVICES)
        DeviceFacts("cpu", 1, 1, 0, None),  # no GPU
        DeviceFacts("cuda:0", 0, None, 8, 0),  # no LOCAL_RANK: nothing to compare with
    ],
)
def test_right_device_mappings_give_no_advice(facts: DeviceFacts) -> None:
    assert check(facts) is None


# -- cross-rank comparisons ---------------------------------------------------------------------


def rank_state(rank: int, host: str = "node-a", **fields: object) -> schema.RankState:
    return schema.RankState(rank=rank, host=host, job="j", **fields)  # type: ignore[arg-type]


def test_two_ranks_on_one_gpu_of_one_host() -> None:
    states = [
        rank_state(r, data=schema.DataInfo(gpu_uuid=uuid))
        for r, uuid in enumerate(["GPU-a", "GPU-a", "GPU-b"])
    ]
    states.append(
        rank_state(3, host="node-b", data=schema.DataInfo(gpu_uuid="GPU-a"))
    )  # another host
    found = compare.shared_gpu(states)
    assert found is not None and found.ranks == [0, 1]
    assert "GPU-a" in found.evidence[0]


def test_same_data_needs_three_equal_steps_and_leaves_a_fixed_batch_alone() -> None:
    varying = schema.Fingerprints(batch=[[s, 100 + s] for s in range(1, 6)])
    fixed = schema.Fingerprints(batch=[[s, 7] for s in range(1, 6)])
    two_steps = schema.Fingerprints(batch=[[1, 101], [2, 102]])
    assert (
        compare.same_data(
            [rank_state(0, fingerprints=varying), rank_state(1, fingerprints=varying)]
        )
        is not None
    )
    assert (
        compare.same_data([rank_state(0, fingerprints=fixed), rank_state(1, fingerprints=fixed)])
        is None
    )
    assert (
        compare.same_data(
            [rank_state(0, fingerprints=two_steps), rank_state(1, fingerprints=two_steps)]
        )
        is None
    )
    other = schema.Fingerprints(batch=[[s, 200 + s] for s in range(1, 6)])
    found = compare.same_data(
        [
            rank_state(0, fingerprints=varying),
            rank_state(1, fingerprints=other),
            rank_state(2, fingerprints=varying),
        ]
    )
    assert found is not None and found.ranks == [0, 2]


def test_the_odd_replica_is_named_with_its_first_differing_tensor() -> None:
    names = ["a.weight", "a.bias", "buffer:bn.running_mean"]

    def prints(*per: int) -> schema.Fingerprints:
        return schema.Fingerprints(params=[schema.ParamPrint(10, sum(per), list(per))], names=names)

    states = [
        rank_state(0, fingerprints=prints(1, 2, 3)),
        rank_state(1, fingerprints=prints(1, 2, 4)),
        rank_state(2, fingerprints=prints(1, 2, 3)),
    ]
    found = compare.replicas_diverged(states)
    assert found is not None
    assert (
        "rank(s) 1 differ from rank 0 at step 10, first in buffer:bn.running_mean" in found.summary
    )
    assert any("broadcast_buffers" in e for e in found.evidence)
    same = [rank_state(r, fingerprints=prints(1, 2, 3)) for r in range(3)]
    assert compare.replicas_diverged(same) is None


def test_each_tensor_s_checksum_is_its_own_with_small_tensors_among_them() -> None:
    # a bias of 2 elements among the parameters, a buffer of 1 (num_batches_tracked) at the end
    model = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 8), nn.BatchNorm1d(8))
    prints = replicas.ParamPrints(model)
    prints.take(10)
    assert prints.collect()
    step, _, per = prints.prints[-1]
    assert step == 10 and len(per) == len(prints.names)
    for (name, t), digest in zip(prints.tensors, per):
        n = t.numel()
        every = max(1, n // replicas.PARAM_SAMPLE)
        positions = range(n) if n <= replicas.PARAM_SAMPLE else range(every // 2, n, every)
        expected = [
            float(t.detach().reshape(-1)[i]) for i in list(positions)[: replicas.PARAM_SAMPLE]
        ]
        assert digest == crc(expected), name
    assert sample(torch.arange(100), 4).tolist() == [12, 37, 62, 87]


def test_nan_origin_is_the_earliest_rank() -> None:
    states = [
        rank_state(
            0,
            fingerprints=schema.Fingerprints(
                nonfinite=schema.NonFinite(8, "out.bias"), nonfinite_checked_step=9
            ),
        ),
        rank_state(
            1,
            fingerprints=schema.Fingerprints(
                nonfinite=schema.NonFinite(7, "inp.weight"), nonfinite_checked_step=9
            ),
        ),
        rank_state(2, fingerprints=schema.Fingerprints(nonfinite_checked_step=9)),
    ]
    found = compare.nonfinite_origin(states)
    assert found is not None and found.ranks == [1] and "step 7, in inp.weight" in found.summary
    assert any("0" in e and "consequences" in e for e in found.evidence)
    assert any("rank(s) 2 had finite gradients" in e for e in found.evidence)


def test_every_kind_has_a_fix_and_is_documented() -> None:
    advice_md = (ROOT / "docs" / "advice.md").read_text()
    for kind in KINDS:
        assert f"| `{kind}` |" in advice_md, kind


# -- the doctor: rank_as_device, verdict kept ----------------------------------------------------


def test_invalid_device_ordinal_is_explained(tmp_path: Path) -> None:
    crash = {
        "unix": states.NOW,
        "exception": "RuntimeError: CUDA error: invalid device ordinal",
        "where": "train.py:12 in main",
    }
    states.write(
        tmp_path,
        states.state(0, local_rank=0, exit={"unix": states.NOW, "exception": None, "where": None}),
    )
    states.write(tmp_path, states.state(1, local_rank=0, host="node-c", exit=crash))
    d = examine(str(tmp_path), live_stacks=False)
    found = [f for f in d.findings if f.kind == "rank_as_device"]
    assert len(found) == 1 and found[0].ranks == [1]
    assert "LOCAL_RANK 0" in found[0].evidence[0] and "LOCAL_RANK" in found[0].fix


def test_advice_keeps_a_healthy_verdict(tmp_path: Path) -> None:
    for rank in (0, 1):
        body = states.state(rank)
        body["advice"] = [
            schema.to_json(
                schema.Advice(
                    "static_graph", "info", "the graph is static", fix="static_graph=True", step=50
                )
            )
        ]
        states.write(tmp_path, body)
    d = examine(str(tmp_path), live_stacks=False)
    assert d.verdict == "healthy"
    found = [f for f in d.findings if f.kind == "static_graph"]
    assert len(found) == 1 and found[0].ranks == [0, 1]


def _epochs_seen(train: Callable[[DataLoader, DistributedSampler], None]) -> list[int]:
    """The epochs found drawn again while ``train`` iterates a shuffling sampler's loader."""
    from ddpmon.rank.advice import data

    watch = data.EpochWatch()
    repeated: list[int] = []

    def drawn(sampler: object, epoch: int) -> None:
        found = watch.drawn(sampler, epoch)
        if found is not None:
            repeated.append(found)

    ds = TensorDataset(torch.arange(64.0).unsqueeze(1))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True)

    def loader_seen(_loader: object) -> None:
        pass

    data.watch(loader_seen, drawn)
    try:
        train(DataLoader(ds, batch_size=4, sampler=sampler), sampler)
    finally:
        data.unwatch(loader_seen, drawn)
    assert DistributedSampler.__iter__ is not data._sampler_iter  # restored
    return repeated


def test_a_peek_before_the_epoch_loop_is_not_an_epoch() -> None:
    def tutorial(loader: DataLoader, sampler: DistributedSampler) -> None:
        len(next(iter(loader))[0])  # PyTorch's DDP tutorial: the batch size, from one batch
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for _ in loader:
                pass

    assert _epochs_seen(tutorial) == []


def test_an_epoch_drawn_again_without_set_epoch_is_found() -> None:
    def no_set_epoch(loader: DataLoader, _sampler: DistributedSampler) -> None:
        next(iter(loader))  # a peek does not hide it
        for _epoch in range(2):
            for _ in loader:
                pass

    def half_epochs(loader: DataLoader, _sampler: DistributedSampler) -> None:
        for _epoch in range(2):  # each epoch cut short after most of its batches
            for i, _ in enumerate(loader):
                if i == 6:
                    break

    assert _epochs_seen(no_set_epoch) == [0]
    assert _epochs_seen(half_epochs) == [0]


def test_the_sampled_checks_thin_out_once_the_job_is_past_its_first_steps() -> None:
    checked = [step for step in range(1, 1001) if cadence.due(step, 50)]
    assert checked[:50] == list(range(1, 51))  # every step at first
    assert [s for s in checked if 50 < s <= 500] == list(range(60, 501, 10))
    assert [s for s in checked if s > 500] == list(range(550, 1001, 50))
    # the next checked step after each step: what the advice sleeps until
    assert [cadence.next_due(s, 50) for s in range(0, 1000)] == [
        next(c for c in checked if c > s) for s in range(0, 1000)
    ]
    batches = data.BatchPrints()
    assert batches.due(99) and not batches.due(101) and batches.due(110) and not batches.due(510)


def tiny_job() -> tuple[DDP, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A small DDP model in the test's one-rank group, its optimizer and one batch."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), torch.randn(4, 8), torch.randn(4, 2)


def test_the_inner_module_is_hooked_on_checked_steps_alone_and_a_bypass_named_on_one(
    group: None, tmp_path: Path
) -> None:
    """A hook on the inner module puts each of its calls on torch's slower path, so it is
    there on the checked steps alone; DDP's own forwards across the hook's comings and
    goings are no bypass, and a training forward on the inner module in a checked step is."""
    ddp, opt, x, y = tiny_job()
    hooked = {}
    with ddpmon.attach(ddp, job="inner", port=-1, state_dir=str(tmp_path / "state")) as mon:
        for step in range(1, 111):
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            hooked[step] = len(ddp.module._forward_pre_hooks)
            if step == 110:  # a checked step (every 10th past step 99)
                loss = loss + nn.functional.mse_loss(ddp.module(x), y)
            loss.backward()
            opt.step()
            if step == 109:
                assert mon.snapshot()["advice"] == []  # DDP's forwards were never a bypass
        found = mon.snapshot()["advice"]
    assert [step for step, n in hooked.items() if n] == [*range(1, 100), 100, 110]
    assert [(f["kind"], f["step"]) for f in found] == [("inner_module_forward", 110)]
    assert "step 110" in found[0]["evidence"][0] and "test_advice.py" in found[0]["summary"]
    assert not ddp.module._forward_pre_hooks  # gone at detach


def test_step_hooks_that_failed_leave_the_advice_seeing_ddp_s_forwards(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The advice hears of DDP's forwards from the step hooks' pre-hook: once the step hooks
    switched themselves off, it still does, so DDP's own call of the inner module is no
    bypass."""
    ddp, opt, x, y = tiny_job()
    with ddpmon.attach(ddp, job="off", port=-1, state_dir=str(tmp_path / "state")) as mon:
        for step in range(1, 21):
            if step == 5:

                def broken(self: Recorder, now: float) -> None:
                    raise RuntimeError("a bug in the step hooks")

                monkeypatch.setattr(Recorder, "forward_started", broken)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        snap = mon.snapshot()
    assert "a bug in the step hooks" in snap["errors"]["step_hooks"]
    assert snap["advice"] == []


def test_a_late_checked_step_has_its_gradient_hooks_and_finds_the_first_nan_there(
    group: None, tmp_path: Path
) -> None:
    """Between checked steps the advice does nothing, and it arms the gradient checks at the
    step before each checked one: past step 500 those are every 50th, so a NaN that starts
    in step 550 is found in step 550, and the hooks were there in the checked steps alone."""
    ddp, opt, x, y = tiny_job()
    weight = ddp.module[0].weight
    hooked = []
    with ddpmon.attach(ddp, job="late", port=-1, state_dir=str(tmp_path / "state")) as mon:
        for step in range(1, 556):
            opt.zero_grad()
            batch = torch.full_like(x, float("nan")) if step == 550 else x
            loss = nn.functional.mse_loss(ddp(batch), y)
            if weight._backward_hooks:
                hooked.append(step)
            loss.backward()
            opt.step()
        found = mon.snapshot()["advice"]
    assert [s for s in hooked if s > 50] == [*range(60, 501, 10), 550]
    assert [(f["kind"], f["step"]) for f in found] == [("nonfinite_gradients", 550)]
    assert "step 550" in found[0]["summary"]
