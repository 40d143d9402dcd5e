"""The daemon's image definition agrees with the package and the DaemonSet that runs it.
(No container engine here: tests/integration/test_torch_free.py installs exactly what the
Dockerfile copies into a torch-free virtualenv and runs the daemon there.)"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "daemon.Dockerfile"
IGNORE = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")
DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied() -> list[str]:
    return [src for word, args in instructions() if word == "COPY" for src in args.split()[:-1]]


def test_slim_python_and_no_torch() -> None:
    steps = instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "pip install /tmp/ddpmon" in runs and "torch is installed" in runs
    assert not re.search(r"pip install[^&]*\btorch\b", runs)
    assert ("ENTRYPOINT", '["ddpmon"]') in steps


def test_copies_what_the_build_needs_and_the_context_holds_it() -> None:
    readme = re.search(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    sources = copied()
    assert readme and {"pyproject.toml", readme.group(1), "ddpmon"} <= set(sources)
    patterns = [
        p.strip() for p in IGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for source in sources:
        assert (ROOT / source).exists(), source
        kept = False  # .dockerignore: the last matching pattern wins; "!" re-includes
        for pattern in patterns:
            if fnmatch.fnmatch(source, pattern.lstrip("!")):
                kept = pattern.startswith("!")
        assert kept, f"{source} is excluded from the build context by {IGNORE.name}"


def test_the_daemonset_runs_this_image() -> None:
    text = DAEMONSET.read_text()
    assert "deploy/docker/daemon.Dockerfile" in text
    assert re.search(r"^\s+image: ddpmon-daemon:\S+", text, re.MULTILINE)
    assert re.search(r'^\s+command: \["ddpmon"\]', text, re.MULTILINE)
