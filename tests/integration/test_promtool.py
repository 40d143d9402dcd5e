"""promtool (from Debian's prometheus package) checks the shipped config and rules and runs
the rules' unit tests in deploy/prometheus/tests/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration import promserver

PROMTOOL = promserver.binary("promtool")
DEPLOY = promserver.ROOT / "deploy" / "prometheus"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        PROMTOOL is None, reason=promserver.MISSING.replace("prometheus binary", "promtool binary")
    ),
]


def promtool(*args: str, cwd: Path = promserver.ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL or "promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_check_config_accepts_the_shipped_prometheus_yml() -> None:
    done = promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout


def test_check_rules_finds_every_rule() -> None:
    rules = yaml.safe_load((DEPLOY / "ddpmon-rules.yml").read_text())
    count = sum(len(g["rules"]) for g in rules["groups"])
    done = promtool("check", "rules", str(DEPLOY / "ddpmon-rules.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {count} rules found" in done.stdout


def test_rule_unit_tests_pass() -> None:
    tests = sorted((DEPLOY / "tests").glob("*.yml"))
    assert tests
    done = promtool("test", "rules", *map(str, tests))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout + done.stderr


def test_rule_unit_tests_catch_a_wrong_expectation(tmp_path: Path) -> None:
    """The promtool tests compare labels and annotations: a changed expectation fails."""
    original = (DEPLOY / "tests" / "ddpmon-rules.test.yml").read_text()
    broken = original.replace("../ddpmon-rules.yml", str(DEPLOY / "ddpmon-rules.yml"))
    broken = broken.replace(
        "rank 1 made no progress for 13m 0s", "rank 1 made no progress for 12m 0s"
    )
    assert broken.count(str(DEPLOY)) == 1 and "12m 0s" in broken
    path = tmp_path / "broken.test.yml"
    path.write_text(broken)
    done = promtool("test", "rules", str(path))
    assert done.returncode != 0
    assert "DDPJobNoProgress" in done.stdout + done.stderr
