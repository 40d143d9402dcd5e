"""Where the boards are written: a directory the user names, or a source checkout's
generated files (dashboards/*.json and two Kubernetes manifests).

Nothing here picks a place by itself: the installed package is never a target, and the
checked-in files are rewritten only for a source tree named explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

from .boards import build
from .kubernetes import configmap, prometheus_rule
from .model import render

RULES = Path("deploy", "prometheus", "ddpmon-rules.yml")
"""The alert rules of a source tree, relative to its root: the PrometheusRule carries them."""


def export(directory: str | os.PathLike[str] = ".") -> list[Path]:
    """Write every dashboard into ``directory`` (created if missing); return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, board in build().items():
        path = out / name
        path.write_text(render(board), encoding="utf-8")
        paths.append(path)
    return paths


def source_root(root: str | os.PathLike[str]) -> Path:
    """``root`` when it is a ddpmon source checkout; ValueError saying what is missing if not."""
    path = Path(root)
    missing = [str(p) for p in (Path("pyproject.toml"), RULES) if not (path / p).is_file()]
    if missing:
        raise ValueError(
            f"{str(root)!r} is not a ddpmon source checkout (no {' or '.join(missing)} in it): "
            "pass the repository root, the directory with pyproject.toml"
        )
    return path


def generated_files(root: str | os.PathLike[str]) -> dict[Path, str]:
    """Every generated file of the source tree rooted at ``root``, with its content."""
    root = source_root(root)
    boards = build()
    files = {root / "dashboards" / name: render(board) for name, board in boards.items()}
    files[root / "deploy" / "kubernetes" / "dashboards-configmap.yaml"] = configmap(boards)
    rules = (root / RULES).read_text(encoding="utf-8")
    files[root / "deploy" / "kubernetes" / "prometheusrule.yaml"] = prometheus_rule(rules)
    return files


def stale_files(root: str | os.PathLike[str]) -> list[Path]:
    """The generated files of ``root`` that are missing or differ from what the code makes."""
    return [
        path
        for path, text in generated_files(root).items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]


def write_generated(root: str | os.PathLike[str]) -> list[Path]:
    """Rewrite the generated files of the source tree rooted at ``root``; return the paths."""
    paths = []
    for path, text in generated_files(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
