"""Recorder arithmetic and the exporter's families, read back through a real registry."""

from __future__ import annotations

import dataclasses
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from ddpmon.httpd import serve
from ddpmon.metrics import catalog
from ddpmon.rank.exporter import RankCollector
from ddpmon.rank.recorder import BucketTiming, Histogram, Recorder
from ddpmon.state import schema
from ddpmon.state.schema import Identity

IDENTITY = dict(
    rank=1,
    local_rank=1,
    world_size=4,
    host="h",
    pid=1,
    job="j",
    backend="gloo",
    torch_version="2.13.0",
    debug_level="OFF",
)


def recorder_with_steps() -> Recorder:
    rec = Recorder(Identity(**IDENTITY), world_size=4)
    rec.set_bucket_layout(0, 4000, "float32", ["a.weight"])
    rec.set_bucket_layout(1, 8000, "float32", ["b.weight", "b.bias"])
    t = 0.0
    for _ in range(3):
        rec.forward_started(t)
        rec.batch_seen(8, 8 * 128)  # token ids: 8 sequences of 128
        rec.forward_finished(t + 0.01)
        rec.backward_started(t + 0.02)
        rec.backward_done(t + 0.05)
        rec.bucket_launched(False)
        rec.bucket_launched(True)
        rec.close_step(t + 0.1)
        rec.add_bucket_timings(
            [BucketTiming(0, 0.03, 10.0, 10.002), BucketTiming(1, 0.05, 10.001, 10.005)]
        )
        t += 0.1
    return rec


H100 = schema.FlopCount(
    per_step=10**12,
    step=2,
    dtype="bfloat16",
    device_name="NVIDIA H100 80GB HBM3",
    peak_flops_per_second=989.4e12,
    peak_source="datasheet",
)


def test_throughput_is_per_second_of_step_time_without_the_counted_step() -> None:
    rec = recorder_with_steps()  # 3 steps of 0.1 s, 8 samples and 1,024 tokens each
    t = rec.throughput()
    assert (t.samples_total, t.tokens_total, t.window_steps) == (24, 3072, 3)
    assert t.samples_per_second == pytest.approx(80.0) and t.tokens_per_second == pytest.approx(
        10240.0
    )
    assert t.flop_count is None and t.achieved_flops_per_second is None and t.mfu is None
    rec.flop_count, rec.slowed_step = H100, 2
    rec.forward_started(0.3)  # a fourth step, twice as long, without a batch seen
    rec.close_step(0.5)
    t = rec.throughput()
    assert t.window_steps == 3 and t.step_seconds == pytest.approx(
        (0.1 + 0.1 + 0.2) / 3
    )  # step 2 left out
    assert t.samples_per_second == pytest.approx(16 / 0.4)
    assert t.achieved_flops_per_second == pytest.approx(10**12 / t.step_seconds)
    assert t.mfu == pytest.approx(t.achieved_flops_per_second / 989.4e12)
    assert rec.state().throughput == t  # the state file's, the same figures


def test_histogram_uses_prometheus_le_semantics() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 1), ("1.0", 2), ("+Inf", 3)]
    assert h.sum == pytest.approx(2.6)


def test_bucket_and_exposed_arithmetic() -> None:
    rec = recorder_with_steps()
    b0, b1 = rec.bucket_stats()
    assert b0.last_seconds == pytest.approx(0.002)
    assert b1.last_seconds == pytest.approx(0.004)
    assert b1.last_busbw == pytest.approx(
        3.0e6
    )  # 8000 bytes in 4 ms, times 2(n-1)/n = 1.5 for 4 ranks
    assert b0.bytes_total == 3 * 4000
    exposed = rec.histograms()["exposed_comm"]
    # last bucket launched at 10.001, last collective done at 10.005
    assert exposed.count == 3 and exposed.sum == pytest.approx(0.012)
    snap = rec.snapshot()
    assert snap["step"] == 3
    assert snap["timings"]["backward_seconds"]["median"] == pytest.approx(0.03)
    assert snap["timings"]["exposed_comm_seconds"]["median"] == pytest.approx(0.004)


def test_rebuilt_bucket_starts_a_new_series() -> None:
    rec = recorder_with_steps()
    rec.set_bucket_layout(0, 5000, "float32", ["a.weight", "c.weight"])
    assert rec.bucket_stats()[0].seconds.count == 0
    rec.drop_buckets_from(1)
    assert [b.index for b in rec.bucket_stats()] == [0]


def read(mode: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(recorder_with_steps(), mode))
    return registry


def test_per_bucket_series() -> None:
    reg = read("per_bucket")
    labels = {"job": "j", "rank": "1", "bucket": "1"}
    assert reg.get_sample_value("ddpmon_allreduce_seconds_count", labels) == 3
    assert reg.get_sample_value("ddpmon_allreduce_bytes_total", labels) == 24000
    assert reg.get_sample_value("ddpmon_steps_total", {"job": "j", "rank": "1"}) == 3


def test_aggregate_and_off_modes_bound_the_series() -> None:
    agg = read("aggregate")
    assert (
        agg.get_sample_value(
            "ddpmon_allreduce_seconds_count", {"job": "j", "rank": "1", "bucket": "all"}
        )
        == 6
    )
    assert (
        agg.get_sample_value(
            "ddpmon_allreduce_seconds_count", {"job": "j", "rank": "1", "bucket": "0"}
        )
        is None
    )
    off = read("off")
    assert (
        off.get_sample_value(
            "ddpmon_allreduce_seconds_count", {"job": "j", "rank": "1", "bucket": "all"}
        )
        is None
    )
    assert off.get_sample_value("ddpmon_steps_total", {"job": "j", "rank": "1"}) == 3


def test_aggregate_folds_every_bucket_into_one() -> None:
    agg, all_ = read("aggregate"), {"job": "j", "rank": "1", "bucket": "all"}
    assert agg.get_sample_value("ddpmon_bucket_size_bytes", all_) == 12000
    assert agg.get_sample_value("ddpmon_bucket_parameters", all_) == 3
    assert agg.get_sample_value("ddpmon_bucket_ready_seconds", all_) == pytest.approx(0.05)
    per = read("per_bucket")
    busbw = [
        per.get_sample_value(
            "ddpmon_allreduce_bus_bandwidth_bytes_per_second", {**all_, "bucket": str(b)}
        )
        for b in (0, 1)
    ]
    # back to back: 12,000 bytes over the two buckets' times (bytes / busbw, one factor)
    assert agg.get_sample_value(
        "ddpmon_allreduce_bus_bandwidth_bytes_per_second", all_
    ) == pytest.approx(12000 / (4000 / busbw[0] + 8000 / busbw[1]))


def series(registry: CollectorRegistry) -> list[tuple[str, dict[str, str]]]:
    return [(s.name, s.labels) for f in registry.collect() for s in f.samples]


@pytest.mark.parametrize(("detail", "world"), [("summary", 4), ("auto", 257)])
def test_summary_keeps_what_the_catalog_marks(detail: str, world: int) -> None:
    rec = recorder_with_steps()
    rec.identity = dataclasses.replace(rec.identity, world_size=world)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(rec, "per_bucket", detail=detail))
    kept = series(registry)
    names = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n, _ in kept}
    assert names == {m.name for m in catalog.METRICS if m.summary} - {
        "ddpmon_attempt",  # absent without a launcher that restarts
        "ddpmon_mfu_ratio",  # absent without a known peak
        "ddpmon_activity",  # absent with the watchdog off
        "ddpmon_advice",
        "ddpmon_internal_errors_total",
        "ddpmon_process_resident_memory_bytes",  # the host's collector: not given here
        "ddpmon_memory_growth_bytes_per_second",  # absent until the memory trends are fitted
        "ddpmon_memory_creep_seconds_left",  # absent while nothing creeps
    }
    assert {labels["bucket"] for _, labels in kept if "bucket" in labels} == {"all"}
    assert [float(labels["le"]) for n, labels in kept if n == "ddpmon_step_seconds_bucket"] == [
        *catalog.get("ddpmon_step_seconds").summary_bounds,
        float("inf"),
    ]
    assert [labels["le"] for n, labels in kept if n == "ddpmon_allreduce_seconds_bucket"] == [
        "+Inf"
    ]
    # the kept buckets count what the full histogram counts at the same bounds
    full = CollectorRegistry(auto_describe=False)
    full.register(RankCollector(recorder_with_steps(), "per_bucket", detail="full"))
    at = {"job": "j", "rank": "1", "le": "0.1"}
    assert registry.get_sample_value("ddpmon_step_seconds_bucket", at) == full.get_sample_value(
        "ddpmon_step_seconds_bucket", at
    )
    assert len(kept) <= 40


def test_auto_is_full_up_to_its_world_size() -> None:
    rec = recorder_with_steps()
    rec.identity = dataclasses.replace(rec.identity, world_size=256)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(rec, "per_bucket"))
    assert ("ddpmon_micro_steps_total", {"job": "j", "rank": "1"}) in series(registry)


def test_every_exported_name_is_in_the_catalog_and_well_named() -> None:
    for m in catalog.METRICS:
        assert m.name.startswith("ddpmon_")
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert "job" in m.labels or m.source == "daemon", m.name
        assert not {"step", "parameter", "timestamp", "param"} & set(m.labels), m.name


def test_the_rank_endpoint_serves_every_rank_metric_of_the_catalog_with_its_labels() -> None:
    """What a rank's endpoint serves and what the catalog (and so README and the dashboards)
    promises are the same names, kinds and label names, both ways."""
    rec = recorder_with_steps()
    rec.identity.bucket_timing = "c10d"  # the one metric served only with c10d timing
    rec.identity.attempt = 0  # ddpmon_attempt: only under a launcher that restarts
    rec.collective_ended(rec.collective_began("barrier", "0", 4, None, "train.py:1", "f"))
    rec.record_error("watchdog", "boom")
    rec.write_failures["state"] = schema.WriteFailure(
        "No space left on device", 1.0, 1.0, "ENOSPC"
    )  # once one failed
    rec.advice.append(schema.Advice(kind="same_data"))  # served once the rank saw a mistake
    rec.activity = schema.Activity(state="stepping")  # served once the watchdog sampled the rank
    rec.flop_count = H100  # the FLOP figures: once counted, the peak and MFU on a known GPU
    rec.data_info = schema.DataInfo(global_batch_size=32)  # once a step has ended
    rec.learning_rate_seen("SGD", 0.1)  # once the optimizer stepped
    served: dict[str, tuple[str, set[tuple[str, ...]]]] = {}
    rank_0 = Recorder(Identity(**dict(IDENTITY, rank=0)), world_size=4)  # the job's goodput
    rank_0.forward_started(0.0)
    families = [*RankCollector(rec, "per_bucket").collect(), *RankCollector(rank_0).collect()]
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        label_sets = {tuple(sorted(k for k in s.labels if k != "le")) for s in family.samples}
        served[name] = (family.type, served.get(name, ("", set()))[1] | label_sets)
    promised = {m.name: m for m in catalog.METRICS if m.source == "rank"}
    assert set(served) == set(promised)
    for name, (kind, label_sets) in served.items():
        assert kind == promised[name].kind, name
        assert label_sets == {tuple(sorted(promised[name].labels))}, name


def test_endpoint_binds_port_zero_and_serves() -> None:
    endpoint = serve(RankCollector(recorder_with_steps()), 0, "127.0.0.1")
    try:
        assert endpoint.port > 0
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert 'ddpmon_steps_total{job="j",rank="1"} 3.0' in body
    finally:
        endpoint.close()


def test_auto_mode_aggregates_above_the_limit() -> None:
    from ddpmon.config import AUTO_PER_BUCKET_LIMIT

    assert (
        read("auto").get_sample_value(
            "ddpmon_allreduce_seconds_count", {"job": "j", "rank": "1", "bucket": "0"}
        )
        == 3
    )
    rec = recorder_with_steps()
    for i in range(2, AUTO_PER_BUCKET_LIMIT + 1):
        rec.set_bucket_layout(i, 100, "float32", [f"p{i}"])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(rec, "auto"))
    assert (
        registry.get_sample_value(
            "ddpmon_allreduce_seconds_count", {"job": "j", "rank": "1", "bucket": "all"}
        )
        == 6
    )
    assert (
        registry.get_sample_value(
            "ddpmon_bucket_size_bytes", {"job": "j", "rank": "1", "bucket": "5"}
        )
        is None
    )


def test_rank_info_says_where_bucket_timing_comes_from_and_c10d_counts_unmatched_steps() -> None:
    rec = Recorder(Identity(**IDENTITY, bucket_timing="c10d"), world_size=4)
    rec.unmatched_steps = 3
    families = {f.name: f for f in RankCollector(rec).collect()}
    (info,) = families["ddpmon_rank_info"].samples
    assert info.labels["bucket_timing"] == "c10d"
    (unmatched,) = families["ddpmon_bucket_timing_unmatched_steps"].samples
    assert unmatched.value == 3 and unmatched.labels == {"job": "j", "rank": "1"}
    hooked = {
        f.name
        for f in RankCollector(Recorder(Identity(**IDENTITY, bucket_timing="hook"), 4)).collect()
    }
    assert "ddpmon_bucket_timing_unmatched_steps" not in hooked


def test_activity_is_a_state_set_of_the_watchdogs_last_sample() -> None:
    """One series per activity, 1 for the current one: Prometheus tells the rank everyone
    waits for (stuck) from those that wait; absent until the watchdog has sampled the rank."""
    rec = recorder_with_steps()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(rec))
    assert (
        registry.get_sample_value("ddpmon_activity", {"job": "j", "rank": "1", "activity": "stuck"})
        is None
    )
    rec.activity = schema.Activity(state="stuck", where="train.py:12 in load_batch")
    values = {
        a: registry.get_sample_value("ddpmon_activity", {"job": "j", "rank": "1", "activity": a})
        for a in catalog.RANK_ACTIVITIES
    }
    assert values == {"stepping": 0.0, "busy": 0.0, "waiting": 0.0, "stuck": 1.0}
    rec.activity = schema.Activity(state="waiting")
    assert (
        registry.get_sample_value(
            "ddpmon_activity", {"job": "j", "rank": "1", "activity": "waiting"}
        )
        == 1.0
    )
    assert (
        registry.get_sample_value("ddpmon_activity", {"job": "j", "rank": "1", "activity": "stuck"})
        == 0.0
    )


def test_the_activities_are_the_watchdogs_and_the_doctors_words() -> None:
    from ddpmon.activity import Status

    assert set(catalog.RANK_ACTIVITIES) < set(catalog.DAEMON_ACTIVITIES) <= {str(s) for s in Status}
    assert {"dead", "crashed", "frozen"} <= set(catalog.DAEMON_ACTIVITIES)


def test_buckets_seen_without_a_comm_hook_are_marked_with_the_end_of_backward() -> None:
    """Without a comm hook DDP's buckets are launched and done all at once, with the end of
    backward compute and DDP's wait for them (``timing/untimed.py``); the state still lists
    each bucket with its size, in order, numbered after what the group issued before; a
    backward that raised never waits for them, and the next forward takes them off."""
    rec = Recorder(Identity(**IDENTITY), world_size=4)
    rec.ddp_group = ("0", 4)
    rec.untimed_sizes = [1_000_000, 24_000_000]
    t = time.perf_counter()
    rec.collective_began("broadcast", "0", 4, 8, "train.py:1", "f")  # seq 1 of the group
    rec.forward_started(t)
    rec.backward_started(t + 0.01)
    rec.backward_done(t + 0.02)  # a no_sync micro-step: nothing launched
    assert [c for c in rec.state().in_flight if c.bucket is not None] == []
    rec.backward_done(t + 0.03, allreduce=True)
    state = rec.state()
    assert state.stage == "allreduce"
    assert [(c.bucket, c.bytes, c.seq, c.op) for c in state.in_flight][-2:] == [
        (0, 1_000_000, 2, "all_reduce"),
        (1, 24_000_000, 3, "all_reduce"),
    ]
    rec.gradients_synced(t + 0.04)
    state = rec.state()
    assert state.stage == "after_backward"
    assert [c for c in state.in_flight if c.bucket is not None] == []
    assert state.collective_log[-1].bucket == 1 and state.collective_seq["0"] == 3
    rec.close_step(t + 0.05)
    rec.forward_started(t + 0.06)
    rec.backward_started(t + 0.07)
    rec.backward_done(t + 0.08, allreduce=True)  # and DDP's wait raised
    assert [c.seq for c in rec.state().in_flight if c.bucket is not None] == [4, 5]
    rec.forward_started(t + 1.0)
    assert [c for c in rec.state().in_flight if c.bucket is not None] == []
    assert rec.state().collective_log[-1].seq == 5
