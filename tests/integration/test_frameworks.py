"""The framework integrations in real 2-process CPU jobs (gloo), tiny models built from code:
Lightning's DDP strategy with DDPMonCallback, transformers.Trainer with its DDPMonCallback,
and Accelerate with ``ddpmon.attach(model)`` after ``accelerator.prepare``. Each job
accumulates 2 batches per optimizer step, and ddpmon's step count must equal the
framework's own. A framework that is not installed skips its test."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).with_name("framework_job.py"))
TIMEOUT = 200


def needs(*packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]' installs it)")


def run_job(framework: str, out: Path, torchrun: bool) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    for name in [n for n in env if n.startswith("DDPMON_")]:
        del env[name]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if torchrun else [sys.executable]
    proc = subprocess.run([*launcher, JOB, framework, str(out)], cwd=out, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def check(out: Path, steps: int = 4) -> None:
    for rank in (0, 1):
        result = json.loads((out / f"result-{rank}.json").read_text())
        assert result["framework_steps"] == steps
        assert result["state_file"] == str(out / "state" / f"rank-{rank}.json")
        state = json.loads(Path(result["state_file"]).read_text())
        assert (state["rank"], state["world_size"], state["step"]) == (rank, 2, steps)
        assert state["buckets"] or state["ddp"], state  # it saw DDP's side, not just a process


def test_lightning_ddp_strategy_on_two_cpu_devices(tmp_path: Path) -> None:
    needs("lightning")
    run_job("lightning", tmp_path, torchrun=False)  # Lightning starts the second process
    check(tmp_path)


def test_transformers_trainer(tmp_path: Path) -> None:
    needs("transformers", "accelerate")
    run_job("transformers", tmp_path, torchrun=True)
    check(tmp_path)
    assert json.loads((tmp_path / "result-0.json").read_text())["wrapped"] == "DistributedDataParallel"


def test_accelerate_prepare_then_attach(tmp_path: Path) -> None:
    needs("accelerate")
    run_job("accelerate", tmp_path, torchrun=True)
    check(tmp_path)


def test_core_import_stays_light_and_missing_frameworks_are_named() -> None:
    code = (
        "import sys, ddpmon, ddpmon.launch, ddpmon.integrations, ddpmon.integrations.accelerate\n"
        "heavy = [m for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "sys.modules.update(lightning=None, pytorch_lightning=None, transformers=None)\n"
        "for name in ('lightning', 'transformers'):\n"
        "    try:\n"
        "        __import__('ddpmon.integrations.' + name)\n"
        "    except ImportError as exc:\n"
        "        assert f\"pip install 'ddpmon[{name}]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
