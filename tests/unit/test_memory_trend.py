"""Memory trends (ddpmon/memory.py), the cgroup's headroom, and the memory_creep finding on
state files: a steady leak creeps, noise and a rise that came once do not, a leak that
stopped does not; each known pattern gets its cause."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ddpmon import memory
from ddpmon.collectors.host import cgroup_headroom
from ddpmon.doctor import examine, words
from ddpmon.state import records, schema
from tests.support import states

pytestmark = pytest.mark.timeout(30)
MIB = 1 << 20


def series(per_step: float, steps: int = 100, every: int = 3, noise: float = 0.0, seed: int = 0):
    """Readings every ``every`` steps from step 10, one a second, ``per_step`` bytes a step
    and uniform noise of +-``noise`` bytes."""
    rng = random.Random(seed)
    return [
        memory.Point(s, 1000.0 + i, int(500 * MIB + per_step * s + rng.uniform(-noise, noise)))
        for i, s in enumerate(range(10, steps + 1, every))
    ][-memory.WINDOW :]


def trend(points: list[memory.Point], **kw: object) -> schema.MemoryTrend:
    return memory.trend(points, "rank", "rss", 1, **kw)  # type: ignore[arg-type]


def test_a_steady_leak_creeps_at_its_rate_through_noise() -> None:
    t = trend(series(4 * MIB, noise=8 * MIB), limit="host", headroom_bytes=10_000 * MIB)
    assert memory.creeping(t) and t.sustained
    assert t.bytes_per_step == pytest.approx(4 * MIB, rel=0.1)
    assert t.bytes_per_second == pytest.approx(12 * MIB, rel=0.1)  # 3 steps a second
    assert memory.seconds_left(t) == pytest.approx(10_000 / 12, rel=0.1)


def test_noise_alone_and_slow_growth_do_not_creep() -> None:
    for seed in range(20):
        assert not memory.creeping(trend(series(0, noise=30 * MIB, seed=seed)))
    assert not memory.creeping(trend(series(0.5 * MIB)))  # below the threshold


@pytest.mark.parametrize("at", [20, 40, 55, 60, 75, 95])
def test_a_rise_that_came_once_and_stayed_flat_does_not_creep(at: int) -> None:
    points = [p._replace(bytes=p.bytes + (300 * MIB if p.step >= at else 0)) for p in series(0)]
    t = trend(points)
    assert not memory.creeping(t), (at, t)
    assert abs(t.bytes_per_step or 0) < memory.CREEP_BYTES_PER_STEP


@pytest.mark.parametrize("samples", [12, 13, 17, 23])
def test_a_rise_read_mid_fill_among_few_samples_has_no_slope(samples: int) -> None:
    """A loaded machine's few samples, one of them taken while the 300 MB were being filled:
    at every place of the rise, neither slope is more than noise (the median of the whole
    window's and its halves' slopes gave up to 179 MB/s here)."""
    rng = random.Random(samples)
    for at in range(samples):
        for share in (0.0, 0.25, 0.5, 0.75):
            points, unix = [], 1000.0
            for i in range(samples):
                unix += rng.uniform(0.05, 0.3)
                rise = 300 * MIB * (1.0 if i > at else share if i == at else 0.0)
                noise = rng.uniform(-0.2, 0.2) * MIB
                points.append(memory.Point(10 + 4 * i, unix, int(500 * MIB + rise + noise)))
            t = trend(points)
            assert not memory.creeping(t), (at, share, t)
            assert abs(t.bytes_per_second or 0) < 4 * MIB, (at, share, t)
            assert abs(t.bytes_per_step or 0) < memory.CREEP_BYTES_PER_STEP / 4, (at, share, t)


def test_a_leak_that_stopped_does_not_creep() -> None:
    points = [p._replace(bytes=500 * MIB + 4 * MIB * min(p.step, 55)) for p in series(0)]
    assert not memory.creeping(trend(points))


def test_too_few_samples_or_steps_give_no_per_step_slope() -> None:
    assert trend(series(4 * MIB)[: memory.MIN_SAMPLES - 1]).bytes_per_step is None
    few_steps = [memory.Point(10 + i // 4, 1000.0 + i, 4 * MIB * i) for i in range(20)]
    assert trend(few_steps).bytes_per_step is None


def test_the_nearest_cgroup_limit_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "job" / "rank").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "job" / "memory.max").write_text(f"{1000 * MIB}\n")
    (v2 / "job" / "memory.current").write_text(f"{600 * MIB}\n")
    (v2 / "job" / "rank" / "memory.max").write_text("max\n")
    (v2 / "job" / "rank" / "memory.current").write_text(f"{100 * MIB}\n")
    assert cgroup_headroom("0::/job/rank\n", str(v2)) == 400 * MIB
    assert cgroup_headroom("0::/elsewhere\n", str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "pod").mkdir(parents=True)
    (v1 / "memory" / "pod" / "memory.limit_in_bytes").write_text(f"{2000 * MIB}\n")
    (v1 / "memory" / "pod" / "memory.usage_in_bytes").write_text(f"{500 * MIB}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1\n")
    assert cgroup_headroom("5:cpu:/\n4:memory:/pod\n", str(v1)) == 1500 * MIB


# -- the finding ------------------------------------------------------------------------------


def rank_memory(*trends: schema.MemoryTrend) -> dict[str, object]:
    return records.dump(schema.Memory(list(trends), states.NOW))


def creeping(process: str, kind: str, pid: int, per_step: float = 4 * MIB) -> schema.MemoryTrend:
    t = memory.trend(series(per_step), process, kind, pid, "host", 20_000 * MIB)
    assert memory.creeping(t) == (per_step >= memory.CREEP_BYTES_PER_STEP)
    return t


def findings(tmp_path: Path, *per_rank: dict[str, object]) -> list:
    states.restart_clock()
    for rank, mem in enumerate(per_rank):
        states.write(tmp_path, states.state(rank, world=len(per_rank), memory=mem))
    d = examine(str(tmp_path), live_stacks=False)
    return [f for f in d.findings if f.kind == "memory_creep"]


def test_the_finding_names_the_rank_its_rate_and_time_left(tmp_path: Path) -> None:
    flat = rank_memory(creeping("rank", "rss", 4000, per_step=0))
    (f,) = findings(tmp_path, flat, rank_memory(creeping("rank", "rss", 4001)), flat)
    assert (f.ranks, f.severity) == ([1], "warning")
    assert f.summary.startswith("rank 1: resident memory grows 4.2 MB a step (45.30 GB an hour)")
    assert "about 27 min left before the host's available memory (20.97 GB free)" in f.summary
    assert f.fix == words.FIX_HOST_LEAK


def test_workers_growing_together_is_copy_on_read(tmp_path: Path) -> None:
    workers = rank_memory(
        creeping("rank", "pss", 4000, per_step=0),
        creeping("worker", "pss", 7001),
        creeping("worker", "pss", 7002),
    )
    (f,) = findings(tmp_path, workers)
    assert f.summary.startswith("rank 0's DataLoader worker (pid 700")
    assert "2 of its 2 workers grow together" in f.summary
    assert "pytorch/pytorch#13246" in f.fix
    one = rank_memory(creeping("worker", "pss", 7001), creeping("worker", "pss", 7002, 0))
    (g,) = findings(tmp_path / "one", one)
    assert "memray" in g.fix and "13246" not in g.fix


def test_reserved_growing_over_a_flat_allocated_is_fragmentation(tmp_path: Path) -> None:
    gpu = rank_memory(
        creeping("rank", "torch_allocated", 4000, per_step=0),
        creeping("rank", "torch_reserved", 4000),
    )
    (f,) = findings(tmp_path, gpu)
    assert "expandable_segments:True" in f.fix and "reserved GPU memory" in f.summary
    both = rank_memory(
        creeping("rank", "torch_allocated", 4000), creeping("rank", "torch_reserved", 4000)
    )
    (g,) = findings(tmp_path / "both", both)
    assert "expandable_segments" not in g.fix and ".item()" in g.fix


def test_thinning_keeps_the_newest_and_every_other() -> None:
    points = [memory.Point(s, float(s), s) for s in range(10, 58)]
    kept = memory.thinned(points)
    assert len(kept) == memory.WINDOW // 2 and kept[-1] == points[-1] and kept[0].step == 11
    assert memory.thinned(points[:5]) == [points[0], points[2], points[4]]


def test_the_watch_samples_fast_steps_every_few_and_thins_its_window() -> None:
    """A real watch on this process, its thread stopped, looked at by hand: steps of 10 ms
    at a state interval of 1 s are sampled every ``SAMPLE_STEPS`` steps until the window is
    full, then half as often, with the readings kept over the same steps."""
    import os
    import time

    from ddpmon.fuses import Fuse
    from ddpmon.rank.memory import MIN_PERIOD, MemoryWatch
    from ddpmon.rank.recorder import Recorder

    rec = Recorder(schema.Identity(rank=0), world_size=1)
    fuse = Fuse("memory_trend")
    watch = MemoryWatch(rec, "cpu", 1.0, fuse)
    watch.stop()
    key = ("rank", os.getpid(), "rss")
    taken = []
    for step in range(1, 300):
        rec.steps = step
        watch.sample()
        series = watch._series.get(key)
        if series and series[-1].step == step:
            taken.append(step)
        time.sleep(0.001)  # a fast step (the watch reads the clock, not this)
    assert fuse.ok
    stride = memory.SAMPLE_STEPS
    first = taken[: memory.WINDOW]
    assert first[0] == memory.WARMUP_STEPS and {b - a for a, b in zip(first, first[1:])} == {stride}
    assert {b - a for a, b in zip(taken[memory.WINDOW :], taken[memory.WINDOW + 1 :])} == {
        2 * stride
    }
    series = watch._series[key]
    assert len(series) < memory.WINDOW and series[0].step == first[1]  # thinned, same span
    assert MIN_PERIOD <= watch.period() < 0.05
    # the trends are fitted once a state interval, not at each sample: the first, so far
    assert [t.samples for t in rec.memory.trends if t.kind == "rss"] == [1]
