"""Training code that ddpmon's authors did not write, run unmodified under ``ddpmon run``
(torchrun form, 2 CPU ranks, gloo, nothing downloaded): Lightning's demo BoringModel under its
DDP strategy, transformers.Trainer on a tiny GPT-2 built from a config, and Accelerate's own
test script of gradient accumulation with and without ``no_sync``
(``accelerate/test_utils/scripts/test_sync.py``). A healthy run must end with no finding
above info; a fault injected from outside the script (tests/support/injector.py, armed by
``INJECT_FAULT`` through a sitecustomize on PYTHONPATH) must get the right verdict, culprit
and place. A package that is not installed skips its tests.

PyTorch's own ``torch/testing/_internal/distributed`` holds no training script: its DDP code
is unittest mixins (``DistributedTest._DistTestBase``) that PyTorch's source tree, not its
wheel, turns into tests, so it is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpmon.doctor import examine

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SITE = ROOT / "tests" / "support" / "inject_site"
JOB_TIMEOUT = 150
"""Seconds a job may take: 15 to 40 s each on the 2-core machine under load."""

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 30)


def needs(*packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]' installs it)")


def start(tmp_path: Path, *argv: str, inject: str = "", **env: str) -> subprocess.Popen:
    """``ddpmon run --nproc-per-node=2 ARGV`` in a session of its own, output to tmp_path."""
    environ = {n: v for n, v in os.environ.items() if not n.startswith(("DDPMON_", "INJECT_"))}
    environ.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **env,
    )
    if inject:
        environ["INJECT_FAULT"] = inject
    return subprocess.Popen(
        [sys.executable, "-m", "ddpmon", "run", "--port", "-1", "-o", "hang_timeout=2"]
        + ["--state-dir", str(tmp_path / "state"), "--nproc-per-node=2", "--max-restarts=0"]
        + list(argv),
        cwd=tmp_path,
        env=environ,
        stdout=open(tmp_path / "run.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def log(tmp_path: Path) -> str:
    return (tmp_path / "run.log").read_text(errors="replace")[-6000:]


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def doctor(state_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", str(state_dir), "--json"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def model_dirs(state: Path) -> list[Path]:
    """The state directory and one more per further DDP model (model-1/, ...)."""
    return sorted({p.parent for p in state.rglob("rank-0.json")})


def loud(answer: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["kind"], f["summary"]) for f in answer["findings"] if f["severity"] != "info"]


def healthy(tmp_path: Path, *argv: str, **env: str) -> list[dict[str, Any]]:
    """Run the job to its end, the doctor asked every second meanwhile (in this process,
    without py-spy) and at the end (the command); no answer may be anything but healthy
    with info notes. The last answer for every model directory the job left."""
    proc = start(tmp_path, *argv, **env)
    state = tmp_path / "state"
    during: list[tuple[str, str, list[tuple[str, str]]]] = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            for d in model_dirs(state):
                answer = examine(str(d), live_stacks=False).as_dict()
                if answer["verdict"] != "healthy" or loud(answer):
                    during.append((d.name, answer["verdict"], loud(answer)))
            time.sleep(1)
        assert proc.wait(timeout=5) == 0, log(tmp_path)
    finally:
        end(proc)
    assert during == [], during
    dirs = model_dirs(state)
    assert dirs, log(tmp_path)
    answers = [doctor(d) for d in dirs]
    for d, answer in zip(dirs, answers):
        assert (answer["verdict"], loud(answer)) == ("healthy", []), (d, answer["findings"])
        assert [f["kind"] for f in answer["findings"]] == ["finished"], answer["findings"]
    return answers


def diagnosed(
    tmp_path: Path, verdict: str, *argv: str, inject: str, until_end: bool = False, **env: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the job with a fault injected and ask the doctor every second until it answers
    ``verdict`` (or, with ``until_end``, once the job has ended); that answer and every one
    before it."""
    proc = start(tmp_path, *argv, inject=inject, **env)
    state = tmp_path / "state"
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while time.monotonic() < deadline:
            ended = proc.poll() is not None
            if until_end and not ended:
                time.sleep(1)
                continue
            if (state / "rank-1.json").exists():
                answers.append(doctor(state))
                if answers[-1]["verdict"] == verdict or ended:
                    return answers[-1], answers
            elif ended:
                break
            time.sleep(1)
    finally:
        end(proc)
    raise AssertionError(f"no {verdict} answer: {[a['verdict'] for a in answers]}\n{log(tmp_path)}")


def finding(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    kinds = [f["kind"] for f in answer["findings"]]
    assert kind in kinds, answer["findings"]
    return answer["findings"][kinds.index(kind)]


def never_blamed_another(answers: list[dict[str, Any]], culprit: int) -> None:
    for a in answers:
        assert set(a["suspect_ranks"]) <= {culprit}, (a["verdict"], a["findings"])


# -- Lightning: its demo BoringModel, its DDP strategy ------------------------------------------


LIGHTNING = str(HERE / "lightning_boring.py")


def test_lightning_boring_model_healthy(tmp_path: Path) -> None:
    needs("lightning")
    healthy(tmp_path, LIGHTNING, "40")


def test_lightning_slow_optimizer_on_one_rank(tmp_path: Path) -> None:
    """Rank 1's SGD.step takes 30 ms more, before it calls Lightning's closure (forward and
    backward run inside the optimizer's step): a straggler, rank 1, in the optimizer (it
    was once called data wait, sending the user to the data loader)."""
    needs("lightning")
    answer, answers = diagnosed(
        tmp_path,
        "straggler",
        LIGHTNING,
        "80",
        inject="slow:1:torch.optim.sgd:SGD.step:seconds=0.03",
        until_end=True,
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("straggler", [1]), answer["findings"]
    summary = finding(answer, "straggler")["summary"]
    assert "in optimizer" in summary and "data wait" not in summary, summary
    never_blamed_another(answers, 1)


# -- transformers.Trainer on a tiny GPT-2 ---------------------------------------------------------


def hf_trainer(tmp_path: Path, steps: int) -> list[str]:
    return [str(HERE / "hf_trainer_tiny.py"), str(tmp_path / "out"), str(steps)]


def test_transformers_trainer_healthy(tmp_path: Path) -> None:
    needs("transformers", "accelerate")
    healthy(tmp_path, *hf_trainer(tmp_path, 40))


def test_transformers_trainer_stalled_optimizer_on_one_rank(tmp_path: Path) -> None:
    """Rank 1's optimizer step never returns from its 11th call: a hang, rank 1, its stack in
    AdamW's step (what the Trainer calls), the other rank waiting in the gradient
    all-reduce."""
    needs("transformers", "accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "hang",
        *hf_trainer(tmp_path, 40),
        inject="stall:1:torch.optim.adamw:AdamW.step:after=10",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("hang", [1]), answer["findings"]
    stuck = finding(answer, "stuck_rank")
    assert "stage optimizer, not in any collective" in stuck["evidence"][0], stuck
    stack = "\n".join(stuck["evidence"])
    assert "transformers/trainer.py" in stack and "injector.py" in stack, stack
    never_blamed_another(answers, 1)


def test_transformers_trainer_extra_barrier_on_one_rank(tmp_path: Path) -> None:
    """Rank 1 issues a barrier of its own before its 11th optimizer step: a desync, rank 1."""
    needs("transformers", "accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "desync",
        *hf_trainer(tmp_path, 40),
        inject="desync:1:torch.optim.adamw:AdamW.step:after=10",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("desync", [1]), answer["findings"]
    assert "injector.py" in json.dumps(answer["findings"]), answer["findings"]  # its call site
    never_blamed_another(answers, 1)


# -- Accelerate's own test script ------------------------------------------------------------------


def accelerate_script(name: str) -> str:
    spec = importlib.util.find_spec("accelerate")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "test_utils" / "scripts" / name)


def test_accelerate_test_sync_healthy(tmp_path: Path) -> None:
    """Accumulation with and without no_sync, several models, on 2 CPU ranks
    (ACCELERATE_USE_CPU: what ``accelerate launch --cpu`` sets)."""
    needs("accelerate")
    answers = healthy(tmp_path, accelerate_script("test_sync.py"), ACCELERATE_USE_CPU="1")
    assert len(answers) >= 2


def test_accelerate_test_sync_killed_rank(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed in its 3rd optimizer step: a dead rank, rank 1."""
    needs("accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "dead_rank",
        accelerate_script("test_sync.py"),
        inject="kill:1:torch.optim.adamw:AdamW.step:after=2",
        ACCELERATE_USE_CPU="1",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("dead_rank", [1]), answer["findings"]
    never_blamed_another(answers, 1)
