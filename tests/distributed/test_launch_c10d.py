"""``node_missing`` in a dynamic rendezvous: two launchers of ``ddpmon run
--rdzv-backend c10d --nnodes=2`` on one host, the second started late. While only the first
waits, its record carries what torch's rendezvous knows and the doctor says how many of how
many nodes joined; once the second arrives, the job runs as it would without ddpmon."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.doctor.rules.launch import ARRIVAL_SECONDS
from ddpmon.state import launcher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (
    "import torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "dist.barrier()\n"
    "dist.destroy_process_group()\n"
)

pytestmark = pytest.mark.timeout(150)


def env() -> dict[str, str]:
    out = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    out.pop("DDPMON_STATE_DIR", None)
    out.pop("DDPMON_JOB", None)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_c10d_rendezvous_short_of_a_node_is_counted_then_completes(tmp_path: Path) -> None:
    state_dir, script = tmp_path / "state", tmp_path / "meet.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "ddpmon", "run", "--port", "-1", "--state-dir", str(state_dir)]
    cmd += ["--job", "c10d", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", endpoint, str(script)]

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = start()
    second = None
    try:
        deadline = time.monotonic() + 60
        while True:  # its record shows the rendezvous, one node in it, for long enough
            paths = launcher.list_paths(str(state_dir))
            record = launcher.read(paths[0])[0] if paths else None
            seen = record.rendezvous if record else None
            if (
                record
                and seen
                and seen.joined
                and (record.now_unix or 0) - (record.stage_since_unix or 0) > ARRIVAL_SECONDS
            ):
                break
            assert time.monotonic() < deadline and first.poll() is None, record
            time.sleep(0.2)
        assert (seen.min_nodes, seen.max_nodes, len(seen.joined)) == (2, 2, 1), seen
        assert record.rdzv_backend == "c10d" and record.node_rank is None
        doctor = subprocess.run(
            [sys.executable, "-m", "ddpmon", "doctor", "--json", str(state_dir)],
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        answer = json.loads(doctor.stdout)
        assert doctor.returncode == 1 and answer["verdict"] == "not_started", doctor.stdout
        found = answer["findings"][0]
        assert found["kind"] == "node_missing", found
        assert found["summary"].startswith(
            f"the c10d rendezvous at {endpoint} has 1 of 2 nodes after "
        ), found["summary"]
        assert found["summary"].endswith("; 1 node never arrived: no launcher of its is seen")
        second = start()  # the late node: the rendezvous completes and the job runs
        out_first, _ = first.communicate(timeout=90)
        out_second, _ = second.communicate(timeout=30)
        assert first.returncode == 0 and second.returncode == 0, out_first + out_second
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
