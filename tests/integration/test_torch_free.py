"""ddpmon installed the way users install it, by pip from this checkout's sources (its real
packaging metadata, its dependencies from the package index):

- into a fresh virtualenv without torch, as on a node or in the daemon's image: the doctor
  diagnoses recorded state files, the daemon serves them, attach says torch is missing;
- into an environment that has torch: torch is left exactly as it was.

Skipped only when pip cannot reach its package index (and never under CI, where that is a
failure). About 10 to 30 s, mostly pip.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import torch_free
from tests.support.commands import serving_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "daemon.Dockerfile"
PIP_TIMEOUT = 300

pytestmark = pytest.mark.timeout(600)


def clean_env() -> dict[str, str]:
    """This environment without what would make the venv import from elsewhere."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    return dict(env, PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")


def sh(
    *cmd: str | Path, cwd: Path, timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


def make_venv(path: Path) -> Path:
    """A fresh virtualenv (no system site-packages) whose pip can reach its index; its python."""
    sh(sys.executable, "-m", "venv", path, cwd=path.parent, timeout=120)
    python = path / "bin" / "python"
    require_index(python, path.parent)
    return python


def require_index(python: Path, tmp: Path) -> None:
    """Skip (fail under CI) when pip cannot download from its index."""
    out = sh(
        python,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--dest",
        tmp / "probe",
        "prometheus-client",
        cwd=tmp,
        timeout=PIP_TIMEOUT,
        check=False,
    )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["?"]
        why = next((line for line in lines if "Error" in line and "Connection" in line), lines[-1])
        reason = f"pip cannot reach its package index: {why.strip()[:300]}"
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI must reach it: this test installs ddpmon's dependencies)")
        pytest.skip(reason)


def source_copy(dest: Path) -> Path:
    """What the daemon image's Dockerfile copies (pyproject.toml, README.md, ddpmon/), copied
    to ``dest``: pip builds there, leaving the checkout without build/ or egg-info."""
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source, dest / source, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(ROOT / source, dest / source)
    assert (dest / "pyproject.toml").exists() and (dest / "ddpmon" / "__init__.py").exists(), (
        DOCKERFILE
    )
    return dest


def site_packages(python: Path) -> Path:
    return Path(
        sh(
            python,
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            cwd=python.parent,
        ).stdout.strip()
    )


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A virtualenv without torch, ddpmon installed by ``pip install SOURCE``, as in the
    daemon's image."""
    tmp = tmp_path_factory.mktemp("torch-free")
    python = make_venv(tmp / "venv")
    sh(python, "-m", "pip", "install", "-q", source_copy(tmp / "src"), cwd=tmp, timeout=PIP_TIMEOUT)
    yield python


def test_installs_without_torch(bare: Path) -> None:
    listed = json.loads(sh(bare, "-m", "pip", "list", "--format", "json", cwd=bare.parent).stdout)
    names = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    assert names.get("ddpmon") == read_version()
    assert {"prometheus-client", "psutil", "nvidia-ml-py"} <= set(names)
    assert "torch" not in names
    assert not [n for n in names if n.startswith("nvidia-") and n != "nvidia-ml-py"], (
        names
    )  # CUDA wheels
    probe = sh(
        bare,
        "-c",
        "import importlib.util, ddpmon, importlib.metadata as m; "
        "print(importlib.util.find_spec('torch')); print(ddpmon.__file__); print(m.requires('ddpmon'))",
        cwd=bare.parent,
    ).stdout.splitlines()
    assert probe[0] == "None"
    assert Path(probe[1]).is_relative_to(
        site_packages(bare)
    )  # the installed copy, not this checkout
    assert "torch" not in probe[2], probe[2]


def test_doctor_on_recorded_state(bare: Path, tmp_path: Path) -> None:
    state = torch_free.copy_state(tmp_path / "state")
    out = sh(bare.parent / "ddpmon", "doctor", "--json", state, cwd=tmp_path, check=False)
    assert out.returncode == 1, out.stderr  # a problem was found
    report = json.loads(out.stdout)
    assert report["verdict"] == "dead_rank", report["findings"]
    assert report["suspect_ranks"] == [torch_free.KILLED_RANK]
    dead = [f for f in report["findings"] if f["kind"] == "dead_rank"]
    assert dead and dead[0]["ranks"] == [1] and dead[0]["summary"].startswith("rank 1 died first")
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[0]["status"] == "crashed" and ranks[0]["step"] == 44
    assert ranks[1]["status"] in ("dead", "silent")  # silent: recorded on another host


def test_daemon(bare: Path, tmp_path: Path) -> None:
    out = sh(bare.parent / "ddpmon", "daemon", "--help", cwd=tmp_path)
    assert "--state-dir" in out.stdout and "--node-local" in out.stdout
    state = torch_free.copy_state(tmp_path / "state")
    proc = subprocess.Popen(
        [
            str(bare.parent / "ddpmon"),
            "daemon",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--state-dir",
            str(state),
            "--node-local",
            "--interval",
            "0.2",
        ],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = serving_port(proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'ddpmon_rank_up{job="killed",rank="1"} 0.0' in metrics, metrics
        assert "ddpmon_daemon_info{" in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0


def test_attach_without_torch(bare: Path) -> None:
    out = sh(bare, "-c", "import ddpmon; ddpmon.attach(object())", cwd=bare.parent, check=False)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ddpmon.errors.AttachError: ddpmon.attach needs PyTorch"), out.stderr
    assert "No module named 'torch'" in last


def test_torch_is_never_touched(tmp_path: Path) -> None:
    """A venv that sees this environment's torch distribution (a .pth line, as
    --system-site-packages would): installing ddpmon leaves it exactly as it was."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed in the environment running the tests")
    package = Path(str(dist.locate_file("torch")))
    info = next(
        Path(str(dist.locate_file(f))).parent
        for f in dist.files or ()
        if f.name == "METADATA" and f.parent.name.endswith(".dist-info")
    )
    visible = tmp_path / "torch-site"
    visible.mkdir()
    for path in (package, info):
        (visible / path.name).symlink_to(path)
    python = make_venv(tmp_path / "venv")
    version = sh(python, "-c", "import pip; print(pip.__version__)", cwd=tmp_path).stdout
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (22, 2):  # for --report
        sh(python, "-m", "pip", "install", "-q", "pip>=22.2", cwd=tmp_path, timeout=PIP_TIMEOUT)
    (site_packages(python) / "torch-site.pth").write_text(f"{visible}\n")
    show = "import importlib.metadata as m; d = m.distribution('torch'); print(d.version, d.locate_file(''))"
    before = sh(python, "-c", show, cwd=tmp_path).stdout
    assert before.split()[0] == dist.version
    record = fingerprint(info)

    source = source_copy(tmp_path / "src")
    report = tmp_path / "report.json"  # first what pip would do, so a mistake downloads nothing
    sh(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--dry-run",
        "--report",
        report,
        source,
        cwd=tmp_path,
        timeout=PIP_TIMEOUT,
    )
    planned = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "ddpmon" in planned and "torch" not in planned, planned
    assert not [n for n in planned if n.startswith("nvidia-") and n != "nvidia-ml-py"], planned
    out = sh(python, "-m", "pip", "install", source, cwd=tmp_path, timeout=PIP_TIMEOUT)

    assert not re.search(
        r"^(Collecting|Downloading|Uninstalling|Requirement already satisfied:) torch\b",
        out.stdout,
        re.MULTILINE,
    ), out.stdout
    installed = next(
        line for line in out.stdout.splitlines() if line.startswith("Successfully installed")
    )
    assert not [n for n in installed.split()[2:] if n.startswith("torch-")], installed
    assert sh(python, "-c", show, cwd=tmp_path).stdout == before
    assert fingerprint(info) == record and package.is_dir()
    assert [p.name for p in site_packages(python).glob("torch*")] == ["torch-site.pth"]


def fingerprint(info: Path) -> str:
    """torch's RECORD (every installed file with its hash) and METADATA, hashed."""
    return hashlib.sha256(
        (info / "RECORD").read_bytes() + (info / "METADATA").read_bytes()
    ).hexdigest()


def read_version() -> str:
    for line in (ROOT / "ddpmon" / "version.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip("\"'")
    raise AssertionError("no __version__ in ddpmon/version.py")
