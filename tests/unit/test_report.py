"""The report, its summary and the comparison, on synthetic history stores (no job). (The
commands in an interpreter without torch: tests/processes/test_report_command.py.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from ddpmon.cli import main
from ddpmon.report import compare, html, run, summary
from ddpmon.state import history
from tools import synthetic


def _cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_summary_names_the_straggler_and_its_part(slow_run):
    s = summary.summarize(run.load([slow_run], findings=False))
    assert s["job"] == "slow" and s["ranks"] == 4 and s["steps"] == 300
    assert s["slowest_rank"]["rank"] == 2 and s["slowest_rank"]["part"] == "backward"
    assert s["slowest_rank"]["excess_seconds"] == pytest.approx(0.03, rel=0.1)
    slower = {
        r["rank"]: r["slower"] for r in s["per_rank"]
    }  # the doctor's scale: 0.33 = 33% slower
    assert slower[2] == pytest.approx(0.33, abs=0.01) and all(
        abs(slower[r]) < 0.05 for r in (0, 1, 3)
    )
    assert s["slowest_rank"]["score"] == s["straggler"]["score"] == slower[2]
    phases = s["parts"]
    assert sum(v for v in phases.values() if v) == pytest.approx(s["median_step_seconds"], rel=0.05)
    assert [b["index"] for b in s["buckets"]] == [0, 1, 2, 3]
    # 25 MiB in 4.2 ms (the median of 4 ms times 1.0 to 1.1), times 2(n-1)/n = 1.5 for 4 ranks
    assert s["buckets"][0]["bytes"] == 25 * 2**20
    assert s["buckets"][0]["median_seconds"] == pytest.approx(0.0042, rel=0.01)
    assert s["buckets"][0]["busbw_bytes_per_second"] == pytest.approx(9.36e9, rel=0.01)
    assert s["per_rank"][0]["status"]["status"] == "exited"


def test_the_end_of_run_summary_applies_the_doctors_straggler_rule(slow_run, even_run):
    s = summary.summarize(run.load([slow_run], findings=False))["straggler"]
    assert (s["rank"], s["named"], s["cause"]) == (2, True, "backward")
    assert s["score"] == pytest.approx(0.33, abs=0.01)  # 30 ms more than the others' 92 ms
    text = summary.end_of_run(slow_run)
    assert "  straggler: rank 2 is" in text and "in backward" in text, text
    even = summary.summarize(run.load([even_run], findings=False))["straggler"]
    assert not even["named"]
    assert "no straggler: the slowest rank" in summary.end_of_run(even_run)


def test_the_end_of_run_summary_counts_host_to_device_copies_as_the_doctor_does(tmp_path):
    synthetic.write_run(str(tmp_path), 4, 300, slow_rank=2, slow_seconds=0.03, slow_part="h2d")
    s = summary.summarize(run.load([str(tmp_path)], findings=False))["straggler"]
    assert (s["rank"], s["named"], s["cause"]) == (2, True, "h2d")
    assert "in host-to-device copies" in summary.end_of_run(str(tmp_path))


def test_html_is_self_contained_and_carries_the_runs_numbers(slow_run):
    r = run.load([slow_run], findings=False)
    s = summary.summarize(r)
    page = html.render(r, s)
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page)  # nothing fetched
    data = json.loads(
        re.search(
            r'<script id="ddpmon-data" type="application/json">(.*?)</script>', page, re.S
        ).group(1)
    )
    ids = [c["id"] for c in data["charts"]]
    assert ids == [
        "step_time",
        "parts",
        "exposed_comm",
        "bucket_time",
        "bucket_busbw",
        "straggler",
        "gpu_util",
        "memory",
        "gpu_memory",
    ]
    gpu_memory = next(c for c in data["charts"] if c["id"] == "gpu_memory")
    assert gpu_memory["unit"] == "MiB" and set(gpu_memory["series"][1]["values"]) == {
        21500
    }  # 21 GiB, 4 digits
    step = data["charts"][0]
    assert step["unit"] == "ms" and [x["name"] for x in step["series"]] == [
        f"rank {i}" for i in range(4)
    ]
    assert step["x"]["values"][-1] == 300
    straggler = next(c for c in data["charts"] if c["id"] == "straggler")
    rank2 = [v for v in straggler["series"][2]["values"] if v is not None]
    assert min(rank2) > 1.2
    assert "uPlot" in page and 'data-key="slowest rank"' in page


def test_many_ranks_draw_the_slowest_lines_and_the_spread(tmp_path):
    synthetic.write_run(str(tmp_path), 40, 50, slow_rank=33, buckets=1)
    r = run.load([str(tmp_path)], findings=False)
    charts = html.charts(r, summary.summarize(r))
    names = [x["name"] for x in charts[0]["series"]]
    assert len(names) == html.MAX_LINES + 2 and "rank 33" in names
    assert names[-2:] == ["median of 40 ranks", "max of 40 ranks"]


def test_several_state_dirs_make_one_run(slow_run, tmp_path):
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir(), b.mkdir()
    for rank in range(4):
        shutil.copy(
            history.path_for(slow_run, rank), history.path_for(str(a if rank < 2 else b), rank)
        )
    s = summary.summarize(run.load([str(a), str(b)], findings=False))
    assert [r["rank"] for r in s["per_rank"]] == [0, 1, 2, 3] and s["slowest_rank"]["rank"] == 2


def test_compare_names_the_rank_and_part_that_explain_the_change(slow_run, even_run):
    a, _ = compare.load_side(even_run)
    b, _ = compare.load_side(slow_run)
    result = compare.compare(a, b)
    step = result["rows"][0]
    assert step["name"] == "median step time" and step["change"] == pytest.approx(
        0.03 / 0.1, rel=0.2
    )
    text = "\n".join(result["explanation"])
    assert "step time up" in text and "rank 2 explains it" in text and "backward" in text
    same = compare.compare(a, a)
    assert same["explanation"][0].startswith("step time unchanged")


def test_compare_reads_the_json_of_an_older_report(slow_run, even_run, tmp_path):
    """An older ``report --json`` called the parts of a step phases and the busy time
    compute: compared with today's, it explains the change the same way."""
    b, _ = compare.load_side(slow_run)
    old = dict(b, phases=b["parts"], slowest_rank=dict(b["slowest_rank"]))
    del old["parts"]
    old["slowest_rank"]["phase"] = old["slowest_rank"].pop("part")
    old["per_rank"] = [
        {
            (
                "phases"
                if k == "parts"
                else "median_compute_seconds"
                if k == "median_busy_seconds"
                else k
            ): v
            for k, v in r.items()
        }
        for r in b["per_rank"]
    ]
    (tmp_path / "old.json").write_text(json.dumps(old))
    a, _ = compare.load_side(even_run)
    then, _ = compare.load_side(str(tmp_path / "old.json"))
    assert then["parts"] == b["parts"] and then["slowest_rank"]["part"] == "backward"
    assert then["per_rank"][2]["median_busy_seconds"] == b["per_rank"][2]["median_busy_seconds"]
    assert compare.compare(a, then)["explanation"] == compare.compare(a, b)["explanation"]


def test_cli_report_compare_and_their_errors(slow_run, even_run, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = _cli(["report", slow_run, "-o", str(out)], capsys)
    assert code == 0 and out.stat().st_size > 50_000 and "4 ranks" in err
    code, text, _ = _cli(["report", slow_run, "--json"], capsys)
    assert code == 0 and json.loads(text)["slowest_rank"]["rank"] == 2
    summary_file = tmp_path / "slow.json"
    summary_file.write_text(text)
    code, text, _ = _cli(
        ["compare", even_run, str(summary_file), "--html", str(tmp_path / "c.html")], capsys
    )
    assert code == 0 and "rank 2 explains it" in text and (tmp_path / "c.html").exists()
    code, _, err = _cli(["report", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no such directory" in err
    code, _, err = _cli(["report", str(tmp_path / "empty-does-not-exist"), "--json"], capsys)
    assert code == 2
    (tmp_path / "empty").mkdir()
    code, _, err = _cli(["report", str(tmp_path / "empty")], capsys)
    assert code == 2 and "no ddpmon history" in err
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = _cli(["compare", even_run, str(tmp_path / "bad.json")], capsys)
    assert code == 2 and "report --json" in err


def test_the_page_lists_the_captures_and_says_how_to_take_one() -> None:
    from ddpmon.report import html

    none = html._captures_html({"captures": []})
    assert "ddpmon capture STATE_DIR --rank R --compare R2" in none
    page = html._captures_html(
        {
            "captures": [
                {
                    "rank": 1,
                    "state": "ok",
                    "steps": 5,
                    "first_step": 41,
                    "last_step": 45,
                    "trace": "/s/capture-1-ab.pt.trace.json",
                    "reason": None,
                    "written_unix": 0.0,
                },
                {
                    "rank": 3,
                    "state": "error",
                    "steps": 5,
                    "first_step": None,
                    "last_step": None,
                    "trace": None,
                    "reason": "the profiler is busy <elsewhere>",
                    "written_unix": None,
                },
            ]
        }
    )
    assert "rank 1, steps 41 to 45" in page and "/s/capture-1-ab.pt.trace.json" in page
    assert "rank 3, 5 steps" in page and "error: the profiler is busy &lt;elsewhere&gt;" in page


def test_a_history_that_lacks_steps_says_which_and_the_run_lasts_what_its_files_know(
    tmp_path, capsys
):
    """A 44 s job on a disk that filled up: rank 0's history stopped 5 s in (its writes failed
    from then on), rank 1's lost steps 120-340 while full and went on to 25 s; their state
    files (written again once there was room) know how
    far each got and when. The report names the missing steps and does not call it a 25 s run."""
    from ddpmon.state import files

    t0 = 1_790_000_000.0

    def rows(first, last):
        return [
            {
                "step": s,
                "start_unix": t0 + (s - 1) * 0.05,
                "end_unix": t0 + s * 0.05,
                "step_seconds": 0.05,
                "forward_seconds": 0.01,
                "backward_seconds": 0.02,
            }
            for s in range(first, last + 1)
        ]

    for rank in (0, 1):
        store = history.HistoryStore(
            history.path_for(str(tmp_path), rank), {"rank": rank, "job": "full", "world_size": 2}
        )
        store.add_steps(rows(1, 100) if rank == 0 else rows(1, 119))
        if rank == 1:
            store.add_steps(rows(341, 500), missing=(120, 340))
        store.close()
        files.write_atomic(
            str(tmp_path / f"rank-{rank}.json"),
            {
                "rank": rank,
                "world_size": 2,
                "host": "elsewhere",
                "pid": 4000 + rank,
                "job": "full",
                "format": 2,
                "step": 880,
                "phase": "detached",
                "started_unix": t0 - 0.5,
                "now_unix": t0 + 44.1,
                "last_progress_unix": t0 + 44.0,
                "exit": {"unix": t0 + 44.1, "how": "end", "code": 0},
            },
        )
    s = summary.summarize(run.load([str(tmp_path)]))
    assert [r["missing_steps"] for r in s["per_rank"]] == [[(101, 880)], [(120, 340), (501, 880)]]
    assert s["missing_steps"] == [
        {"rank": 0, "first": 101, "last": 880},
        {"rank": 1, "first": 120, "last": 340},
        {"rank": 1, "first": 501, "last": 880},
    ]
    assert s["start_unix"] == t0 and s["duration_seconds"] == pytest.approx(44.0)  # not 25 s
    text = "rank 0 steps 101-880, rank 1 steps 120-340, rank 1 steps 501-880"
    assert f"  missing from the history: {text}" in summary.end_of_run(str(tmp_path))
    page = html.render(run.load([str(tmp_path)]), s)
    assert f'data-key="missing from the history">{text}<' in page
    assert 'data-key="duration">0:00:44<' in page


def test_a_host_whose_clock_is_ahead_changes_no_duration(tmp_path):
    """Two hosts of 8 ranks, one's clock 5 s ahead: the run lasts what each host's own clock
    says (10 s of steps), not the 15 s from one host's start to the other's end; 5 s behind
    neither shortens it."""
    durations = []
    for name, offsets in (("even", {}), ("ahead", {"node1": 5.0}), ("behind", {"node1": -5.0})):
        synthetic.write_run(str(tmp_path / name), 16, 100, clock_offsets=offsets, gpu=False)
        s = summary.summarize(run.load([str(tmp_path / name)]))
        durations.append(s["duration_seconds"])
    assert durations[0] == pytest.approx(10.0, abs=0.2)
    assert durations[1] == pytest.approx(durations[0], abs=1e-6)
    assert durations[2] == pytest.approx(durations[0], abs=1e-6)
