"""The dashboards' commands in a process of their own: the generator's dev command
(``python -m tools.dashboards --write-repo|--check``), ``ddpmon dashboards export`` into the
working directory, push without grafana-client, export into a directory made immutable with
chattr; and the generator imports neither torch nor grafana-client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon import dashboards
from ddpmon.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return int(exit_info.value.code or 0)


# -- the generator's dev command ---------------------------------------------------------------


def test_generator_does_not_import_torch_or_grafana_client() -> None:
    code = (
        "import sys, ddpmon.dashboards, ddpmon.cli.dashboards; ddpmon.dashboards.build(); "
        "print(sorted(m for m in ('torch', 'grafana_client', 'prometheus_client') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _source_tree(root: Path) -> Path:
    """The two inputs of a source checkout the generator needs, copied under ``root``."""
    for rel in ("pyproject.toml", "deploy/prometheus/ddpmon-rules.yml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((ROOT / rel).read_bytes())
    return root


def _dev_command(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.dashboards", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )


def test_write_repo_regenerates_the_files_of_the_named_checkout(tmp_path: Path) -> None:
    tree = _source_tree(tmp_path / "checkout")
    done = _dev_command("--write-repo", str(tree), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = sorted(Path(line).relative_to(tree) for line in done.stdout.split())
    assert [str(p) for p in written] == [
        "dashboards/ddp-gpus.json",
        "dashboards/ddp-job-overview.json",
        "deploy/kubernetes/dashboards-configmap.yaml",
        "deploy/kubernetes/prometheusrule.yaml",
    ]
    for rel in written:  # the same bytes as the checked-in files
        assert (tree / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout"]  # nothing next to it


def test_check_tells_a_stale_checkout_from_a_current_one(tmp_path: Path) -> None:
    tree = _source_tree(tmp_path)
    dashboards.write_generated(tree)
    assert _dev_command("--check", str(tree)).returncode == 0
    board = tree / "dashboards" / "ddp-gpus.json"
    board.write_text(board.read_text().replace("DDP GPUs", "GPUs"))
    done = _dev_command("--check", str(tree))
    assert done.returncode == 1
    assert done.stdout.split() == ["stale:", str(board)]
    assert f"--write-repo {tree}" in done.stderr


@pytest.mark.parametrize("argv", [[], ["--write-repo"], ["--write-repo", "a", "--check", "b"]])
def test_the_dev_command_needs_exactly_one_explicit_root(argv: list[str], tmp_path: Path) -> None:
    done = _dev_command(*argv, cwd=tmp_path)
    assert done.returncode == 2 and "--write-repo" in done.stderr
    assert not list(tmp_path.iterdir())


def test_write_repo_refuses_a_directory_that_is_not_a_checkout(tmp_path: Path) -> None:
    package = ROOT / "ddpmon"
    before = sorted(p.name for p in package.iterdir())
    for target in (package, tmp_path):
        done = _dev_command("--write-repo", str(target))
        assert done.returncode == 2
        assert f"{str(target)!r} is not a ddpmon source checkout" in done.stderr
        assert "deploy/prometheus/ddpmon-rules.yml" in done.stderr
    assert sorted(p.name for p in package.iterdir()) == before
    assert not list(tmp_path.iterdir())


# -- ddpmon dashboards --------------------------------------------------------------------------


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write into: read-only permissions, and for root (whom
    permissions do not stop) the immutable attribute as well."""
    target = tmp_path / "read-only"
    target.mkdir()
    target.chmod(0o555)
    immutable = os.geteuid() == 0
    if (
        immutable
        and subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0
    ):
        target.chmod(0o755)
        pytest.skip("running as root without chattr +i: no directory here is unwritable for root")
    try:
        yield target
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(target)], check=True)
        target.chmod(0o755)


def test_export_into_an_unwritable_directory_is_bad_usage(
    unwritable_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("dashboards", "export", str(unwritable_dir)) == 2
    err = capsys.readouterr().err
    assert f"DIR={str(unwritable_dir)!r} is not writable" in err
    assert not list(unwritable_dir.iterdir())


def _files(*roots: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``roots``, bytecode caches left out."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for root in roots
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_export_without_dir_writes_into_the_current_directory_only(tmp_path: Path) -> None:
    """The real command in a fresh process: the boards land in its working directory, and
    nothing under the ddpmon package (nor the checkout's generated files) is touched."""
    watched = (Path(dashboards.__file__).resolve().parents[1], ROOT / "dashboards", ROOT / "deploy")
    before = _files(*watched)
    assert before
    done = subprocess.run(
        [sys.executable, "-m", "ddpmon", "dashboards", "export"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    after = _files(*watched)
    assert after == before, (
        f"written outside the current directory: {sorted(set(after) - set(before))}"
    )
    assert done.stdout.split() == list(dashboards.BOARDS)  # relative to the current directory
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(dashboards.BOARDS)
    for name in dashboards.BOARDS:
        assert (tmp_path / name).read_bytes() == (ROOT / "dashboards" / name).read_bytes()


def test_push_without_grafana_client_names_the_package() -> None:
    """In a fresh interpreter where grafana_client cannot be imported (as without the extra)."""
    code = (
        "import sys; sys.modules['grafana_client'] = None\n"
        "from ddpmon.cli import main\n"
        "main(['dashboards', 'push', '--url', 'http://127.0.0.1:9', '--token', 't'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "needs the grafana-client package" in done.stderr
    assert "pip install 'ddpmon[grafana]'" in done.stderr
