"""docs/integrations.md's examples, run as they stand in real 2-process CPU jobs (gloo, tiny
models built from code, no download): Lightning's DDP strategy on 2 CPU devices with
DDPMonCallback, transformers.Trainer with its DDPMonCallback (under torchrun), Accelerate
with ``ddpmon.attach(model)`` after ``accelerator.prepare`` (under torchrun). Each example
runs 4 optimizer steps of 2 accumulated batches: every rank's state file must count 4, the
framework's steps, not 8 batches. A framework that is not installed skips its test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "integrations.md").read_text()
EXAMPLES = {
    name: (command, code)
    for name, command, code in re.findall(
        r"<!-- example: (\w+), run as: (.+?) -->\n```python\n(.*?)```", DOC, re.DOTALL
    )
}
TIMEOUT = 200
STEPS = 4


def run_example(name: str, tmp_path: Path, *packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]' installs it)")
    command, code = EXAMPLES[name]
    (tmp_path / "train.py").write_text(code)
    argv = command.split()
    launcher = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    }
    env = {n: v for n, v in os.environ.items() if not n.startswith("DDPMON_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        DDPMON_STATE_DIR=str(tmp_path / "state"),
        DDPMON_PORT="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    proc = subprocess.run(
        [*launcher[argv[0]], *argv[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        state = json.loads((tmp_path / "state" / f"rank-{rank}.json").read_text())
        assert (state["rank"], state["world_size"], state["step"]) == (rank, 2, STEPS)
        assert state["ddp"] and state["stage"] == "detached", state
        assert state["exit"] is None or state["exit"]["exception"] is None


def test_docs_have_the_three_examples() -> None:
    assert sorted(EXAMPLES) == ["accelerate", "lightning", "transformers"]


def test_lightning_ddp_strategy_on_two_cpu_devices(tmp_path: Path) -> None:
    run_example("lightning", tmp_path, "lightning")  # Lightning starts the second process itself


def test_transformers_trainer(tmp_path: Path) -> None:
    run_example("transformers", tmp_path, "transformers", "accelerate")


def test_accelerate_prepare_then_attach(tmp_path: Path) -> None:
    run_example("accelerate", tmp_path, "accelerate")


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
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
