"""Traces read and compared without torch (ddpmon/profiles.py): self times, steps, call sites,
GPU kernels, the comparison's order and wording, and traces that are not traces."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ddpmon import profiles
from ddpmon.errors import StateFileError
from tests.support.traces import frame, op, rank_trace, steps, trace


def test_self_time_is_an_ops_time_less_the_ops_inside_it_per_step() -> None:
    p = profiles.parse(rank_trace(200.0))
    assert p.steps == 2 and (p.rank, p.first_step, p.last_step) == (1, 11, 12)
    assert p.ops[("aten::linear", "cpu")].self_us == pytest.approx(2 * (96 - 80))
    assert p.ops[("aten::addmm", "cpu")].self_us == pytest.approx(2 * 80)
    assert p.ms_per_step(("aten::mm", "cpu")) == pytest.approx((200 + 50) / 1000)
    assert p.ops[("aten::mm", "cpu")].calls == 4
    assert p.total_ms_per_step == pytest.approx((16 + 80 + 250) / 1000)


def test_a_call_site_is_the_innermost_users_frame_and_a_frame_older_than_the_recording_has_no_line() -> (
    None
):
    p = profiles.parse(rank_trace(200.0))
    mm = p.ops[("aten::mm", "cpu")].sites
    assert mm == {
        "forward (model.py:40)": pytest.approx(400.0),
        "main (train.py)": pytest.approx(100.0),
    }
    assert set(p.ops[("aten::addmm", "cpu")].sites) == {"forward (model.py:40)"}


def test_without_step_spans_the_steps_come_from_ddpmons_metadata_else_one() -> None:
    assert profiles.parse(trace([op("aten::mm", 0, 10)], steps=4)).steps == 4
    assert profiles.parse(trace([op("aten::mm", 0, 10)])).steps == 1
    p = profiles.parse(trace([frame("model.py(3): f", 0, 20), op("aten::mm", 1, 10)]))
    assert p.ops[("aten::mm", "cpu")].sites == {"f (model.py:3)": 10.0}  # no steps: every line kept


def test_gpu_kernels_count_whole_and_take_their_launch_site() -> None:
    events = [
        *steps(1),
        frame("model.py(40): forward", 100, 500),
        op("aten::mm", 110, 50),
        op("cudaLaunchKernel", 120, 10, cat="cuda_runtime", correlation=9),
        op("ampere_sgemm_128x64_nn", 300, 700, tid=99, cat="kernel", correlation=9),
        op("Memcpy HtoD", 1000, 40, tid=99, cat="gpu_memcpy", correlation=10),
    ]
    p = profiles.parse(trace(events))
    kernel = p.ops[("ampere_sgemm_128x64_nn", "gpu")]
    assert kernel.self_us == 700 and kernel.sites == {"forward (model.py:40)": 700}
    assert p.ops[("Memcpy HtoD", "gpu")].sites == {}
    assert p.ops[("aten::mm", "cpu")].self_us == 50  # the launch inside it is no op
    assert p.total_ms_per_step == pytest.approx(0.05)  # operator time: the CPU's


def test_compare_puts_the_slow_ranks_extra_op_first_with_its_site() -> None:
    slow, healthy = profiles.parse(rank_trace(4120.0)), profiles.parse(rank_trace(0.0))
    diffs = profiles.compare(slow, healthy)
    assert diffs[0].name == "aten::mm" and diffs[0].delta == pytest.approx(4.12)
    assert diffs[0].site == "forward (model.py:40)"
    assert profiles.line(1, 0, diffs[0]) == (
        "rank 1: +4.1 ms/step in aten::mm (4.2 vs 0.05 on rank 0), "
        "called from forward (model.py:40)"
    )
    assert [d.name for d in diffs] == ["aten::mm"]  # equal ops are left out
    text = profiles.summary(1, slow, 0, healthy)
    assert text[1] == "where rank 1 spends more than rank 0:" and text[2].startswith(
        "  rank 1: +4.1 ms/step"
    )
    back = profiles.compare(healthy, slow)  # the other way round: a shortfall, listed last
    assert back[-1].delta == pytest.approx(-4.12) and back[-1].site == "forward (model.py:40)"
    lines = profiles.summary(0, healthy, 1, slow)
    assert "rank 0 spends no more than rank 1 in any operator" in lines
    assert lines[-1].startswith("  rank 0: -4.1 ms/step in aten::mm")
    assert profiles.as_json(slow, healthy)[0]["delta_ms_per_step"] == pytest.approx(4.12)


def test_frames_of_libraries_are_skipped() -> None:
    for path in (
        "torch/nn/modules/module.py",
        "threading.py",
        "<frozen runpy>",
        "ddpmon/rank/boundary.py",
        "/usr/lib/python3/dist-packages/x.py",
        "json/decoder.py",
    ):
        assert profiles.is_library_file(path), path
    for path in ("model.py", "train/loop.py", "tests/distributed/capture_worker.py"):
        assert not profiles.is_library_file(path), path


@pytest.mark.parametrize(
    "data, reason",
    [
        ([], "is not a Chrome trace (no traceEvents list)"),
        ({"traceEvents": {}}, "is not a Chrome trace (no traceEvents list)"),
    ],
)
def test_what_is_not_a_trace_is_said(data: Any, reason: str) -> None:
    with pytest.raises(StateFileError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        profiles.parse(data, "t.json")


def test_bad_events_are_skipped() -> None:
    p = profiles.parse(
        trace(
            [
                {"ph": "X"},
                "x",
                op("aten::mm", "a", 3),
                op("aten::mm", 0, -1),  # type: ignore[list-item]
                op("aten::add", 0, 5),
            ]
        )
    )
    assert list(p.ops) == [("aten::add", "cpu")]


def test_files_are_read_as_untrusted(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(rank_trace(10.0)))
    assert profiles.read(str(good)).steps == 2
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(StateFileError, match="is not a JSON trace"):
        profiles.read(str(tmp_path / "bad.json"))
    odd = (
        tmp_path / "odd.json"
    )  # torch 2.2 writes some names with stray bytes: not UTF-8, control characters
    text = json.dumps(rank_trace(10.0)).replace("model.py", "model\udc94\n.py")
    odd.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert profiles.read(str(odd)).steps == 2
    os.symlink(good, tmp_path / "link.json")
    with pytest.raises(StateFileError, match="symbolic link"):
        profiles.read(str(tmp_path / "link.json"))


def test_the_largest_excess_comes_first_and_the_largest_shortfall_last() -> None:
    def ranked(mm: float, add: float, total: float, relu: float) -> profiles.Profile:
        return profiles.parse(
            trace(
                [
                    *steps(1, 0, 10000),
                    frame("model.py(40): forward", 0, 9000),
                    op("aten::mm", 10, mm),
                    op("aten::add", 10 + mm, add),
                    op("aten::sum", 10 + mm + add, total),
                    op("aten::relu", 10 + mm + add + total, relu),
                ]
            )
        )

    def named(lines: list[str]) -> list[str]:
        return [line.split(" in ")[1].split(" (")[0] for line in lines if line.startswith("  ")]

    slow, healthy = ranked(3000, 1000, 10, 100), ranked(1, 1, 500, 2000)
    assert [d.name for d in profiles.compare(slow, healthy)] == [
        "aten::mm",
        "aten::add",
        "aten::sum",
        "aten::relu",
    ]
    assert named(profiles.summary(1, slow, 0, healthy)) == [
        "aten::mm",
        "aten::add",
        "aten::relu",
        "aten::sum",
    ]
    assert named(profiles.summary(1, slow, 0, healthy, top=1, fewer=1)) == [
        "aten::mm",
        "aten::relu",
    ]
