"""The silent DDP mistakes on a real 2-rank gloo job (tests/distributed/advice_worker.py):
each found by the ranks (one log line, the ``ddpmon_advice`` gauge) and by the doctor (with
its evidence and fix, the verdict left healthy), and none on the correct twin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.doctor import examine
from tests.support.harness import ROOT, run_ranks

pytestmark = pytest.mark.timeout(240)

EXPECTED = {  # phase: (kinds the ranks record, per rank), kinds the doctor finds
    "same_data": ({0: {"same_data"}, 1: {"same_data"}}, {"same_data"}),
    "no_set_epoch": ({0: {"set_epoch_missing"}, 1: {"set_epoch_missing"}}, {"set_epoch_missing"}),
    "peek_then_set_epoch": ({0: set(), 1: set()}, set()),  # PyTorch's DDP tutorial
    "inner_forward": (
        {0: {"replicas_diverged"}, 1: {"inner_module_forward", "replicas_diverged"}},
        {"inner_module_forward", "replicas_diverged"},
    ),
    "drifting_buffers": (
        {0: {"replicas_diverged"}, 1: {"replicas_diverged"}},
        {"replicas_diverged"},
    ),
    "nan_on_rank_1": (
        {0: {"nonfinite_gradients"}, 1: {"nonfinite_gradients"}},
        {"nonfinite_gradients"},
    ),
    "accumulation": (
        {0: {"accumulation_without_no_sync"}, 1: {"accumulation_without_no_sync"}},
        {"accumulation_without_no_sync"},
    ),
    "static_graph": ({0: {"static_graph"}, 1: {"static_graph"}}, {"static_graph"}),
    "correct": ({0: set(), 1: set()}, set()),
}
ADVICE_KINDS = {k for _, kinds in EXPECTED.values() for k in kinds}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):
    results = run_ranks(
        "advice_job",
        2,
        tmp_path_factory.mktemp("advice"),
        timeout=180,
        module="tests.distributed.advice_worker",
    )
    return {r.rank: r.result for r in results}


@pytest.fixture(scope="module")
def doctor(job):
    return {name: examine(job[0][name]["state_dir"], live_stacks=False) for name in EXPECTED}


@pytest.mark.parametrize("phase", EXPECTED)
def test_ranks_record_each_mistake_once_and_nothing_else(job, phase: str) -> None:
    for rank, kinds in EXPECTED[phase][0].items():
        got = job[rank][phase]
        assert set(got["kinds"]) == kinds, (rank, got)
        for kind in kinds:  # one log line each, however many steps it lasted
            assert sum(f"[{kind}]" in line for line in got["logs"]) == 1, (rank, kind, got["logs"])
        gauge = {line.split('kind="')[1].split('"')[0] for line in got["advice_metrics"]}
        assert gauge == kinds


@pytest.mark.parametrize("phase", EXPECTED)
def test_doctor_finds_it_and_keeps_the_verdict(doctor, phase: str) -> None:
    d = doctor[phase]
    assert d.verdict == "healthy"
    found = {f.kind for f in d.findings if f.kind in ADVICE_KINDS}
    assert found == EXPECTED[phase][1]
    for f in d.findings:
        if f.kind in ADVICE_KINDS:
            assert f.fix and f.summary


def test_same_data_names_both_ranks_and_the_sampler(doctor) -> None:
    f = next(f for f in doctor["same_data"].findings if f.kind == "same_data")
    assert f.ranks == [0, 1]
    assert any("RandomSampler" in e for e in f.evidence)


def test_nan_origin_is_the_rank_with_the_bad_batch(doctor) -> None:
    f = next(f for f in doctor["nan_on_rank_1"].findings if f.kind == "nonfinite_gradients")
    assert f.ranks == [1]
    assert "step 7" in f.summary
    assert any("rank 0: first non-finite gradient in step 8" in e for e in f.evidence)
    assert any("consequences" in e for e in f.evidence)


def test_diverged_replicas_name_rank_tensor_and_cause(doctor, job) -> None:
    inner = next(f for f in doctor["inner_forward"].findings if f.kind == "replicas_diverged")
    assert "rank(s) 1 differ from rank 0 at step 10" in inner.summary
    assert "inp.weight" in inner.summary
    assert any("inner module" in e and "rank(s) 1" in e for e in inner.evidence)
    site = next(f for f in doctor["inner_forward"].findings if f.kind == "inner_module_forward")
    assert site.ranks == [1] and "advice_worker.py:" in site.summary
    buffers = next(f for f in doctor["drifting_buffers"].findings if f.kind == "replicas_diverged")
    assert "buffer:bn.running_mean" in buffers.summary
    assert any("broadcast_buffers" in e for e in buffers.evidence)


def test_a_finding_made_within_a_step_carries_that_step(job) -> None:
    """Found at the fourth optimizer step's pre-hook (the third in a row with 3 all-reduces:
    each backward that all-reduces is a step, docs/metrics.md, so step 12), and while step
    7's batch is drawn (the third of the second epoch's four): the step in progress, not the
    steps done."""
    for phase, kind, step in (
        ("accumulation", "accumulation_without_no_sync", 12),
        ("no_set_epoch", "set_epoch_missing", 7),
    ):
        for rank in (0, 1):
            assert job[rank][phase]["steps"][kind] == step, (phase, rank, job[rank][phase])


def test_the_global_batch_counts_accumulation(job) -> None:
    """Samples per optimizer step: 2 micro-batches of 8 under no_sync (correct) and 3
    without it (accumulation) on 2 ranks; one micro-batch of 8 elsewhere."""
    for phase, micro, line in (
        (
            "correct",
            2,
            "per-rank batch 8 x 2 micro-batches, global batch 32 per optimizer step, sampler DistributedSampler",
        ),
        (
            "accumulation",
            3,
            "per-rank batch 8 x 3 micro-batches, global batch 48 per optimizer step",
        ),
        ("static_graph", 1, "per-rank batch 8, global batch 16 per optimizer step"),
    ):
        logs = job[0][phase]["logs"]
        assert sum(line in m for m in logs) == 1, (phase, logs)
        for rank in (0, 1):
            data = json.loads((Path(job[0][phase]["state_dir"]) / f"rank-{rank}.json").read_text())[
                "data"
            ]
            assert (data["batch_size"], data["micro_batches"], data["global_batch_size"]) == (
                8,
                micro,
                16 * micro,
            )


def test_cli_text_json_and_exit_codes(job) -> None:
    state_dir = job[0]["same_data"]["state_dir"]

    def doctor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ddpmon", "doctor", state_dir, "--no-stacks", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    text = doctor()
    assert text.returncode == 0, (
        text.stderr
    )  # a warning leaves the verdict, and the exit code, healthy
    assert text.stdout.startswith(
        "ddpmon doctor: HEALTHY (no hang or crash), 1 warning: same_data ("
    ), text.stdout
    assert (
        "train on the same batches" in text.stdout
        and "- ranks 0, 1 fed identical batches" in text.stdout
    )
    assert "DistributedSampler" in text.stdout  # the fix
    as_json = json.loads(doctor("--json").stdout)
    assert [f["ranks"] for f in as_json["findings"] if f["kind"] == "same_data"] == [[0, 1]]
    assert doctor("--fail-on-advice").returncode == 1
    clean = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "doctor",
            job[0]["correct"]["state_dir"],
            "--no-stacks",
            "--fail-on-advice",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert clean.returncode == 0, clean.stdout
    assert clean.stdout.startswith("ddpmon doctor: HEALTHY - no problem found ("), clean.stdout
