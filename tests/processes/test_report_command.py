"""``ddpmon report`` and ``ddpmon compare`` in a fresh interpreter where torch cannot be
imported, on synthetic history stores (no job)."""

from __future__ import annotations


def test_report_and_compare_never_import_torch(slow_run, even_run, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch fails
        "from ddpmon.cli import main\n"
        f"try:\n    main(['report', {slow_run!r}, '-o', {str(tmp_path / 'r.html')!r}])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"try:\n    main(['compare', {even_run!r}, {slow_run!r}])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2 explains it" in done.stdout
