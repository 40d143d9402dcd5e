"""The core monitor on real 2-3 rank gloo jobs: buckets, steps, unused parameters, the DDP
error with names, endpoints, state files, gradients unchanged, and the bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import run_ranks
from tests.support.torch_features import COMPILE_CHECK

pytestmark = pytest.mark.timeout(180)


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series NAME with (at least) LABELS in a Prometheus text
    exposition, or None. Parsed by prometheus_client's own parser, which also refuses a
    malformed exposition."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory):
    return run_ranks("train_basic", 3, tmp_path_factory.mktemp("basic"), args=("8",))


def test_every_bucket_is_timed_on_every_rank(basic) -> None:
    for r in basic:
        snap = r.result["snapshot"]
        sizes = r.result["param_bytes"]
        buckets = snap["buckets"]
        # bucket_cap_mb=0.01 splits the 5 layers into 4 buckets once DDP rebuilds them
        assert [b["index"] for b in buckets] == [0, 1, 2, 3]
        named = sorted(n for b in buckets for n in b["parameters"])
        assert named == sorted(sizes), "every parameter is in exactly one bucket, by name"
        for b in buckets:
            assert b["bytes"] == sum(sizes[n] for n in b["parameters"])
            assert b["dtype"] == "float32"
            assert b["count"] >= 7, "timed in every step after the rebuild"
            assert 0 < b["last_seconds"] < 5
            assert b["busbw_bytes_per_second"] > 0
            assert 0 <= b["ready_seconds"] < 5
        # gradients of the last layers are ready first: buckets become ready in index order
        ready = [b["ready_seconds"] for b in buckets]
        assert ready == sorted(ready)


def test_ddps_logging_data_gives_the_layout_the_comm_hook_sees(basic) -> None:
    """The c10d clock has no GradBucket: it reads the layout from DDP's logging data."""
    for r in basic:
        hooked = [
            [b["index"], b["bytes"], b["dtype"], b["parameters"]]
            for b in r.result["snapshot"]["buckets"]
        ]
        assert r.result["logged_count"] == 4
        assert r.result["logged_layout"] == hooked
        assert r.result["snapshot"]["bucket_timing"] == "hook", "auto on gloo: the Python comm hook"


def test_bus_bandwidth_follows_nccl_tests_definition(basic) -> None:
    """nccl-tests' bus bandwidth: the algorithm bandwidth (bytes over seconds) times
    2(n-1)/n, 4/3 for this job's 3 ranks."""
    b = basic[0].result["snapshot"]["buckets"][1]
    assert b["busbw_bytes_per_second"] / (b["bytes"] / b["last_seconds"]) == pytest.approx(
        4 / 3, rel=1e-9
    )


def test_steps_and_phases(basic) -> None:
    for r in basic:
        snap = r.result["snapshot"]
        assert snap["step"] == 8
        t = snap["timings"]
        assert t["window_steps"] == 8
        for key in ("step_seconds", "forward_seconds", "backward_seconds", "exposed_comm_seconds"):
            assert t[key]["median"] > 0, key
        assert t["compute_seconds"]["median"] < t["step_seconds"]["median"]
        assert snap["stage"] == "after_optimizer"  # the last step ended at its optimizer step
        assert snap["collectives"]["issued"] == snap["collectives"]["completed"] > 0


def test_endpoint_serves_catalog_metrics_with_job_and_rank(basic) -> None:
    from ddpmon.metrics import catalog

    for r in basic:
        text = r.result["metrics"]
        rank = str(r.rank)
        assert sample(text, "ddpmon_steps_total", job="basic", rank=rank) == 8
        assert sample(text, "ddpmon_step_seconds_count", job="basic", rank=rank) == 8
        assert sample(text, "ddpmon_forward_seconds_count", job="basic", rank=rank) == 8
        assert sample(text, "ddpmon_backward_seconds_count", job="basic", rank=rank) == 8
        assert sample(text, "ddpmon_exposed_comm_seconds_count", job="basic", rank=rank) >= 7
        assert sample(text, "ddpmon_unused_parameters", job="basic", rank=rank) == 0
        assert (
            sample(
                text,
                "ddpmon_rank_info",
                job="basic",
                rank=rank,
                world_size="3",
                local_rank=rank,
                backend="gloo",
                debug_level="OFF",
            )
            == 1
        )
        for b in r.result["snapshot"]["buckets"]:
            idx = str(b["index"])
            assert (
                sample(text, "ddpmon_allreduce_seconds_count", job="basic", rank=rank, bucket=idx)
                == b["count"]
            )
            assert (
                sample(text, "ddpmon_allreduce_bytes_total", job="basic", rank=rank, bucket=idx)
                == b["bytes_total"]
            )
            assert (
                sample(text, "ddpmon_bucket_size_bytes", job="basic", rank=rank, bucket=idx)
                == b["bytes"]
            )
        names = {
            line.split("{")[0].split(" ")[0]
            for line in text.splitlines()
            if line and line[0] != "#"
        }
        assert names <= catalog.series_names(), names - catalog.series_names()
        for line in text.splitlines():
            if line and line[0] != "#":
                assert 'job="basic"' in line and f'rank="{rank}"' in line, line


def test_state_file_has_the_contract_keys(basic) -> None:
    for r in basic:
        state = r.result["state"]
        assert Path(r.result["state_file"]).name == f"rank-{r.rank}.json"
        for key in (
            "rank",
            "local_rank",
            "world_size",
            "host",
            "pid",
            "port",
            "job",
            "step",
            "stage",
            "last_progress_unix",
            "collectives",
            "in_flight",
            "unused_parameters",
            "hang",
        ):
            assert key in state, key
        assert state["rank"] == r.rank and state["world_size"] == 3 and state["job"] == "basic"
        assert state["pid"] == r.pid
        assert state["port"] == r.result["port"] > 0
        assert state["step"] == 8


@pytest.mark.parametrize(
    "hook,how,ranks",
    [
        ("default", "option", 3),  # 3: a world size whose reciprocal is inexact in binary
        ("fp16", "option", 2),
        ("fp16", "after_attach", 2),
    ],
)
def test_gradients_identical_with_and_without_ddpmon(
    tmp_path: Path, hook: str, how: str, ranks: int
) -> None:
    results = run_ranks("grads_equal", ranks, tmp_path, args=(hook, how))
    for r in results:
        assert r.result["steps_compared"] == 5
        assert r.result["max_diff"] == 0.0
        assert r.result["bucket_counts"] and min(r.result["bucket_counts"]) >= 3
        assert set(r.result["dtypes"]) == {"float32"}
        assert r.result["mode"] == "hook"
        if how == "after_attach":
            assert "can only be called once" in r.result["second_register"]


def test_unused_parameters_named_on_the_rank_that_has_them(tmp_path: Path) -> None:
    results = run_ranks("unused_by_rank", 2, tmp_path)
    expected = {0: ["head_b.weight", "head_b.bias"], 1: ["head_a.weight", "head_a.bias"]}
    for r in results:
        assert r.result["snapshot"]["unused_parameters"] == expected[r.rank]
        assert r.result["state"]["unused_parameters"] == expected[r.rank]
        assert (
            sample(r.result["metrics"], "ddpmon_unused_parameters", job="unused", rank=str(r.rank))
            == 2
        )
        warnings = [line for line in r.stderr.splitlines() if "received no gradient" in line]
        assert len(warnings) == 1, "one warning when the set changes, not one per step"
        assert ", ".join(expected[r.rank]) in warnings[0]


def test_ddp_reduction_error_names_the_unused_parameters(tmp_path: Path) -> None:
    results = run_ranks("reduction_error", 2, tmp_path)
    for r in results:
        error = r.result["error"]
        assert error and "Expected to have finished reduction" in error
        assert "head_b.weight" in error and "head_b.bias" in error
        assert "find_unused_parameters=True" in error


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """One 2-rank job that meets every bad input in turn and keeps training; each test
    below checks one of them, on every rank."""
    return {r.rank: r.result for r in run_ranks("bad_inputs", 2, tmp_path_factory.mktemp("bad"))}


def test_attaching_to_a_plain_module_says_how_to_wrap_it(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert "DistributedDataParallel" in out["not_ddp"] and "MLP" in out["not_ddp"]


def test_attaching_twice_is_refused(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert "already attached" in out["twice"]


def test_a_busy_port_falls_back_to_another_and_says_so(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["bound_port"] not in (None, out["busy_port"])
        assert any(
            f"cannot serve metrics on 127.0.0.1:{out['busy_port']}" in line for line in out["logs"]
        )


def test_an_unwritable_state_dir_turns_state_files_off_and_says_so(
    bad_inputs: dict[int, dict],
) -> None:
    for out in bad_inputs.values():
        assert out["state_file"] is None
        assert any(
            "state files are off" in line and "/proc/ddpmon-cannot-write" in line
            for line in out["logs"]
        )


def test_training_goes_on_through_the_bad_inputs(bad_inputs: dict[int, dict]) -> None:
    assert [out["steps"] for out in bad_inputs.values()] == [
        3,
        3,
    ]  # every step counted at its optimizer step


def test_bad_and_unknown_options_are_named(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert "hang_timeout='soon'" in out["bad_option"]
        assert "colour" in out["unknown_option"] and "hang_timeout" in out["unknown_option"]


def test_a_port_past_the_range_is_refused_on_the_rank_it_falls_on(
    bad_inputs: dict[int, dict],
) -> None:
    assert bad_inputs[0]["port_past_range"] == "accepted"  # 65535 + LOCAL_RANK 0 is a port
    assert "port=65535" in bad_inputs[1]["port_past_range"]
    assert "LOCAL_RANK (1)" in bad_inputs[1]["port_past_range"]


def test_a_comm_hook_torch_refuses_is_a_config_error(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["bad_hook"].startswith("comm_hook=") and "torch refused it" in out["bad_hook"]


def test_c10d_timing_on_gloo_is_refused_with_what_works(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["c10d_on_gloo"].startswith("bucket_timing='c10d'")
        assert "gloo backend has no completion hook" in out["c10d_on_gloo"]
        assert "'hook' or 'auto'" in out["c10d_on_gloo"]


def test_two_monitors_need_state_files_of_their_own(bad_inputs: dict[int, dict]) -> None:
    for rank, out in bad_inputs.items():
        assert (
            f"rank-{rank}.json" in out["same_state_file"] and "state_dir=" in out["same_state_file"]
        )
        assert out["second_state_file"] is True


def test_a_failed_attach_leaves_nothing_behind(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["spare_clean"] == [0, False, None]


def test_a_comm_hook_registered_after_attach_is_timed_after_a_refused_one(
    bad_inputs: dict[int, dict],
) -> None:
    for out in bad_inputs.values():
        assert out.get("later_refused"), "DDP refuses a hook without (state, bucket)"
        assert out["later_modes"] == ["off", "hook"] and out["later_counts"] == [2], out[
            "later_counts"
        ]


def test_bucket_timing_off_registers_no_comm_hook(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["off_hooks"] == [False, ""]


def test_an_attach_failing_part_way_undoes_what_it_installed(bad_inputs: dict[int, dict]) -> None:
    for out in bad_inputs.values():
        assert out["partway"] == "injected: attach fails part-way"
        assert out["partway_clean"] == [False, 0, False, None]
        assert out["partway_reattached_steps"] == 2


def test_failure_inside_a_hook_is_logged_once_and_switches_it_off(tmp_path: Path) -> None:
    results = run_ranks("hook_failure", 2, tmp_path)
    for r in results:
        assert r.result["steps"] == 4, "training went on"
        assert "injected failure" in r.result["errors"]["bucket_timing"]
        assert (
            len(
                [
                    line
                    for line in r.result["logs"]
                    if "bucket_timing failed and is now switched off" in line
                ]
            )
            == 1
        )
        assert (
            sample(r.result["metrics"], "ddpmon_internal_errors_total", part="bucket_timing") == 1
        )


def test_detach_restores_and_reattach_works(tmp_path: Path) -> None:
    for r in run_ranks("detach_and_reattach", 2, tmp_path):
        out = r.result
        assert out["steps_first"] == 3  # detach closes the step in progress: it synchronised
        assert out["steps_after_detach"] == out["steps_first"]
        assert out["forward_restored"] and out["endpoint_closed"]
        assert out["steps_second"] == 3
        assert out["second_buckets"] and min(out["second_buckets"]) >= 2
        assert out["second_mode"] == "hook", (
            "DDP still holds ddpmon's hook: the default times with it"
        )


def test_no_sync_microbatches_fold_into_one_step(tmp_path: Path) -> None:
    for r in run_ranks("no_sync_accumulation", 2, tmp_path):
        snap = r.result["snapshot"]
        assert snap["step"] == 4
        assert snap["unused_parameters"] == []


def test_by_default_gloo_keeps_ddps_own_allreduce_and_still_sees_exposed_comm(
    tmp_path: Path,
) -> None:
    """gloo has no cheap per-bucket timing source: by default no comm hook is registered."""
    for r in run_ranks("without_bucket_timing", 2, tmp_path):
        out = r.result
        assert out["max_diff"] == 0.0
        assert out["steps"] == 4 and out["buckets"] == [] and out["mode"] == "off"
        assert out["comm_hook_at_attach"] == "", "DDP runs its C++ all-reduce, no hook"
        assert out["backward"]["median"] > 0
        assert out["exposed"]["median"] > 0, "exposed communication needs no comm hook on CPU"
        assert (
            sample(
                out["metrics"], "ddpmon_exposed_comm_seconds_count", job="untimed", rank=str(r.rank)
            )
            == 3
        )
        assert out["phases"] == ["after_backward"] * 4, (
            "DDP's wait for its buckets is seen without a hook"
        )
        assert out["synced_after_ddp"] == [True] * 4, "the sync callback runs after DDP's finalize"
        assert sample(out["metrics"], "ddpmon_steps_total", job="untimed", rank=str(r.rank)) == 3
        assert (
            sample(
                out["metrics"], "ddpmon_allreduce_seconds_count", job="untimed", rank=str(r.rank)
            )
            is None
        )
        assert out["registered"] == ["allreduce_hook"]


def test_ddp_on_a_subgroup_keeps_the_jobs_world_size(tmp_path: Path) -> None:
    for r in run_ranks("subgroup", 2, tmp_path):
        assert r.result == {
            "world_size": 2,
            "ddp_world_size": 1,
            "rank": r.rank,
            "steps": 3,
            "buckets": 1,
        }


def test_backward_is_timed_when_the_loss_uses_a_later_output(tmp_path: Path) -> None:
    for r in run_ranks("backward_from_second_output", 2, tmp_path):
        assert r.result["backward"]["median"] > 0
        assert r.result["unused"] == ["aux.weight", "aux.bias"]


def test_c10d_clock_in_a_real_job_matches_completions_to_buckets(tmp_path: Path) -> None:
    for r in run_ranks("c10d_wiring", 2, tmp_path):
        out = r.result
        assert out["mode"] == "c10d" and out["steps"] == 8
        buckets = out["buckets"]
        assert [b["index"] for b in buckets] == [0, 1, 2, 3], "layout from DDP's logging data"
        assert sorted(n for b in buckets for n in b["parameters"]) == sorted(out["param_bytes"])
        for b in buckets:
            assert b["bytes"] == sum(out["param_bytes"][n] for n in b["parameters"])
            # steps 1..7 use the rebuilt buckets and are all matched (step 0 had other buckets)
            assert b["count"] == 7, b
            assert 0 < b["last_seconds"] < 5 and b["busbw_bytes_per_second"] > 0
            assert 0 < b["ready_seconds"] < 5
        assert [b["ready_seconds"] for b in buckets] == sorted(b["ready_seconds"] for b in buckets)
        notes = {
            k: v for k, v in out["notes"].items() if k != "torch_api" or COMPILE_CHECK
        }  # (2.2's line)
        assert out["exposed"]["median"] >= 0 and notes == {}
        assert out["listeners_left"] == 0, "detach stops listening"
        labels = dict(job="c10d", rank=str(r.rank))
        assert sample(out["metrics"], "ddpmon_bucket_timing_unmatched_steps_total", **labels) == 0
        assert sample(out["metrics"], "ddpmon_allreduce_seconds_count", bucket="0", **labels) == 7


def test_steps_are_found_when_the_model_returns_a_dataclass(tmp_path: Path) -> None:
    for r in run_ranks("dataclass_output", 2, tmp_path):
        assert (
            r.result["before_detach"] == 5 and r.result["steps"] == 5
        )  # each at its optimizer step
        assert r.result["backward"]["median"] > 0
