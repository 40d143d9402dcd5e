"""``ddpmon run``: real 2-rank jobs of a script that never mentions ddpmon (plain_train.py),
under torchrun and as ``python script.py`` that spawns its own ranks."""

from __future__ import annotations

import glob
import json
import os
import re
import site
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ddpmon.cli.run import plan_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("plain_train.py"))
TIMEOUT = 180


def ddpmon_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    env.pop("DDPMON_STATE_DIR", None)
    env.pop("DDPMON_JOB", None)
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "run", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def state(path: Path) -> dict:
    return json.loads(path.read_text())


def installed_hooks() -> set[str]:
    """Every .pth file and sitecustomize/usercustomize python could pick up at start."""
    dirs = {
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["stdlib"],
        *site.getsitepackages(),
    }
    found = set()
    for d in dirs:
        for pattern in ("*.pth", "sitecustomize*", "usercustomize*"):
            found.update(glob.glob(os.path.join(d, pattern)))
    return found


def test_torchrun_form_two_models_traceback_and_exit_status(tmp_path: Path) -> None:
    """torchrun's own arguments; each rank builds two DDP models (both monitored, the second
    into model-1/); rank 1 then raises: its traceback is the script's own and the exit
    status is torchrun's."""
    out, state_dir = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    before = installed_hooks()
    proc = ddpmon_run(
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
        "--job",
        "plain",
        "--nproc-per-node=2",
        "--max-restarts=0",
        SCRIPT,
        str(out),
        "--steps",
        "5",
        "--models",
        "2",
        "--fail",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr  # torchrun's status for a failed worker
    for directory in (state_dir, state_dir / "model-1"):
        files = sorted(p.name for p in directory.glob("rank-*.json"))
        assert files == ["rank-0.json", "rank-1.json"], (directory, proc.stderr)
        for rank in (0, 1):
            data = state(directory / f"rank-{rank}.json")
            assert (data["rank"], data["step"], data["job"], data["world_size"]) == (
                rank,
                5,
                "plain",
                2,
            )
    assert (
        state(state_dir / "rank-1.json")["exit"]["exception"]
        == "ValueError: boom from the training script"
    )
    assert state(state_dir / "rank-0.json")["exit"]["exception"] is None
    # every directory ddpmon made is private, and so is every file in it (they hold stacks and paths)
    for path in (state_dir, state_dir / "model-1", *state_dir.rglob("rank-*")):
        want = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == want, path

    for rank in (0, 1):
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen["argv"] == [SCRIPT, str(out), "--steps", "5", "--models", "2", "--fail"]
        assert (seen["name"], seen["file"], seen["path0"]) == (
            "__main__",
            SCRIPT,
            os.path.dirname(SCRIPT),
        )
        assert seen["monitors"] == [
            str(state_dir / f"rank-{rank}.json"),
            str(state_dir / "model-1" / f"rank-{rank}.json"),
        ]
    # the traceback starts at the script's own top frame, as without ddpmon, and names no ddpmon file
    tb = proc.stderr[proc.stderr.index("Traceback (most recent call last):") :]
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', tb.split("ValueError: boom")[0])
    assert frames[0] == (SCRIPT, "<module>"), tb
    assert [name for f, name in frames if f == SCRIPT] == ["<module>", "train", "fail_here"], tb
    assert not any(f.startswith(str(ROOT / "ddpmon")) for f, _ in frames), tb
    # torchrun's failure summary names the script, as without ddpmon
    assert re.search(rf"^{re.escape(SCRIPT)} FAILED$", proc.stderr, re.MULTILINE), proc.stderr
    assert "ddpmon.launch FAILED" not in proc.stderr
    assert f"ddpmon doctor {state_dir}\n" in proc.stderr
    assert f"ddpmon doctor {state_dir / 'model-1'}\n" in proc.stderr
    assert installed_hooks() == before


def test_python_form_spawns_its_own_ranks(tmp_path: Path) -> None:
    """``ddpmon run python script.py``: the ranks are started by torch.multiprocessing.spawn
    (a class of the script pickled to them); each is monitored through a sitecustomize that
    exists only for the run; the script's own ``ddpmon.attach(model)`` gets the monitor
    already there; the script's own exit status comes back."""
    out, state_dir = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    before = installed_hooks()
    proc = ddpmon_run(
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
        "-o",
        "hang_timeout=300",
        sys.executable,
        SCRIPT,
        str(out),
        "--steps",
        "4",
        "--spawn",
        "2",
        "--exit",
        "3",
        "--attach",
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    for rank in (0, 1):
        data = state(state_dir / f"rank-{rank}.json")
        assert (data["rank"], data["step"], data["exit"]["exception"]) == (rank, 4, None)
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen["name"] == seen["net_module"] == "__mp_main__"  # as without ddpmon
        assert seen["monitors"] == [str(state_dir / f"rank-{rank}.json")]
        assert seen["explicit_is_launched"]  # the script's own ddpmon.attach got that monitor
        assert seen["argv"][0] == SCRIPT
        sitedir = seen["pythonpath"].split(os.pathsep)[0]
        assert os.path.basename(sitedir).startswith("ddpmon-run-")
        assert not os.path.exists(sitedir), "the run's sitecustomize outlived the run"
    assert re.search(r"job 'plain_train-\d{8}-\d{6}-\d+'", proc.stderr), proc.stderr
    assert installed_hooks() == before


SHOW = """\
import pickle, sys
class Point:
    pass
def fail():
    raise KeyError("from the script")
if __name__ == "__main__":
    names = sorted(k for k in globals() if k.startswith("__"))
    print(sys.argv, __name__, __file__, sys.path[0], __spec__, type(__loader__).__name__, names)
    print(type(pickle.loads(pickle.dumps(Point()))).__qualname__)
    fail()
"""


def test_launch_runs_a_script_as_python_would(tmp_path: Path) -> None:
    """Same output, traceback and exit status as ``python sub/show.py a b`` (no torch here)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "show.py").write_text(SHOW)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    plain = subprocess.run(
        [sys.executable, "sub/show.py", "a", "-b"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    launched = subprocess.run(
        [sys.executable, "-m", "ddpmon.launch", "sub/show.py", "a", "-b"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == 1 and "KeyError: 'from the script'" in plain.stderr
    assert "['sub/show.py', 'a', '-b'] __main__" in plain.stdout and "Point" in plain.stdout
    assert (launched.returncode, launched.stdout, launched.stderr) == (
        plain.returncode,
        plain.stdout,
        plain.stderr,
    )


def test_python_form_chains_to_an_existing_sitecustomize(tmp_path: Path) -> None:
    """The run's sitecustomize installs the watcher, leaves sys.path as it was, and then runs
    the sitecustomize it stands in front of."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    probe = (
        "import os, sys; print(os.environ.get('THEIRS_RAN'), sys.modules['sitecustomize'].__file__, "
        "'ddpmon.launch' in sys.modules, any('ddpmon-run-' in p for p in sys.path), 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(theirs))))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--state-dir",
            str(tmp_path / "s"),
            sys.executable,
            "-c",
            probe,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", str(theirs / "sitecustomize.py"), "True", "False", "False"]
    assert "no state file" in proc.stderr


def test_plan_puts_the_shim_between_torchrun_and_the_script() -> None:
    torchrun = [sys.executable, "-m", "ddpmon.agent"]  # torchrun, recording its rendezvous
    shim = [
        "--no-python",
        sys.executable,
        "-u",
        "-mddpmon.launch",
    ]  # torchrun's own python, as it would run
    plan = plan_command(["--nproc-per-node=2", "train.py", "--lr", "0.1", "-m"])
    assert plan.argv == torchrun + ["--nproc-per-node=2", *shim, "train.py", "--lr", "0.1", "-m"]
    assert not plan.sitecustomize
    plan = plan_command(
        ["/nowhere/torchrun", "--nnodes", "1", "--rdzv-id", "j7", "-m", "pkg.train", "x"]
    )
    # (a torchrun whose python is not known: the shim as a module, its failures named after it)
    assert plan.argv == [
        "/nowhere/torchrun",
        "--nnodes",
        "1",
        "--rdzv-id",
        "j7",
        "-m",
        "ddpmon.launch",
        "-m",
        "pkg.train",
        "x",
    ]
    assert plan.rdzv_id == "j7"
    assert plan_command(["--no-python", "./train.sh"]).sitecustomize
    plan = plan_command(
        ["bash", "-c", "torchrun --nproc-per-node=2 train.py"]
    )  # a launcher of its own
    assert plan.sitecustomize and plan.argv == [
        "bash",
        "-c",
        "torchrun --nproc-per-node=2 train.py",
    ]
    assert plan_command(["python3", "-u", "train.py"]).argv == ["python3", "-u", "train.py"]
    assert plan_command(["python3", "-u", "train.py"]).script == "train.py"
    # a restarted job's options reach torchrun as given
    restarts = [
        "--nnodes",
        "2",
        "--max-restarts=3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29400",
        "--rdzv-id",
        "run-9",
        "--rdzv-conf",
        "join_timeout=60",
        "train.py",
    ]
    plan = plan_command(restarts)
    assert plan.argv == torchrun + restarts[:-1] + [*shim, "train.py"] and plan.rdzv_id == "run-9"


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "name what to run"),
        (("-o", "nope=1", "train.py"), "-o 'nope=1'"),
        (("--port", "many", "python", "train.py"), "DDPMON_PORT='many' is not valid"),
    ],
)
def test_bad_usage_exits_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = ddpmon_run(*args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_sigint_to_ddpmon_run_alone_ends_the_job_as_torchrun(tmp_path: Path) -> None:
    """`kill -INT` of ddpmon run's pid (not its process group): passed on to torchrun, which
    ends the ranks and exits; a training that would run for hours ends within seconds."""
    import signal
    import time

    out, state_dir = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
            "--job",
            "interrupted",
            "--nproc-per-node=2",
            "--max-restarts=0",
            SCRIPT,
            str(out),
            "--steps",
            "100000000",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not all(
            (state_dir / f"rank-{r}.json").exists()
            and state(state_dir / f"rank-{r}.json")["step"] > 20
            for r in (0, 1)
        ):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=30)
            time.sleep(0.2)
        pids = [state(state_dir / f"rank-{r}.json")["pid"] for r in (0, 1)]
        os.kill(proc.pid, signal.SIGINT)  # this pid alone
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, err  # torchrun's status for an interrupted job
    assert "got signal: 2" in err, err  # torchrun's own words for it
    for pid in pids:  # every rank ended
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )
