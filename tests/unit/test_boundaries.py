"""The layout's rules, read from the source: three runtimes and the leaves they share.

- ``ddpmon/rank/`` runs inside the training process and is the only package that imports
  torch; only the package's face (``ddpmon.attach``), the launcher, the demo and the
  framework integrations import it.
- ``ddpmon/preflight/`` is a job of its own before the training job: its one process module
  (``node``) imports torch; the rest (a node's checks, the verdict) is torch-free.
- The node daemon (``ddpmon/daemon/``) and the offline readers (doctor, report, top,
  dashboards, the CLI) never import the rank wing or torch; the daemon imports only leaves,
  and only its command (``cli/daemon.py``) imports the daemon.
- The leaves that every runtime shares (the on-disk contract ``state/``, ``steps``,
  ``activity``, ``metrics``, ``httpd``, ``collectors``, ``advice``, ``profiles``, ``peaks``,
  ``formats``, ``goodput``, config, errors, frames, fuses, webconfig) import only each other;
  ``state/`` imports no reader.
- The developer's generators live in ``tools/``, outside the package: nothing in ``ddpmon``
  imports them.
- No import circle anywhere, lazy imports included.

Each rule names the import that breaks it, so the next feature cannot cross the line
unnoticed (docs/ARCHITECTURE.md draws the layout).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpmon"
RANK = "ddpmon.rank"
FACES = ("ddpmon", "ddpmon.launch", "ddpmon.demo", "ddpmon.integrations")
"""May import the rank wing: what a training script calls."""
LEAVES = (
    "ddpmon.state",
    "ddpmon.steps",
    "ddpmon.activity",
    "ddpmon.metrics",
    "ddpmon.httpd",
    "ddpmon.collectors",
    "ddpmon.advice",
    "ddpmon.config",
    "ddpmon.errors",
    "ddpmon.frames",
    "ddpmon.fuses",
    "ddpmon.version",
    "ddpmon.profiles",
    "ddpmon.memory",
    "ddpmon.webconfig",
    "ddpmon.peaks",
    "ddpmon.formats",
    "ddpmon.goodput",
    "ddpmon.clocks",
)
TORCH_OUTSIDE_RANK = {
    "ddpmon": "a type hint, under TYPE_CHECKING",
    "ddpmon.demo": "the demo is a training script",
    "ddpmon.integrations._common": "the integrations run inside the training process",
    "ddpmon.cli.run": "torchrun's own argument parser, imported when `ddpmon run` starts a job",
    "ddpmon.agent": "torchrun itself, run by `ddpmon run` in a process that records its rendezvous",
    "ddpmon.cli.preflight": "torchrun's parser and agent, imported when `ddpmon preflight` runs",
    "ddpmon.preflight.node": "preflight is a job of its own: its processes measure the links "
    "between nodes with torch.distributed, as the job will",
}
DAEMON = "ddpmon.daemon"
RANK_READS = {
    (
        "ddpmon.rank.writers",
        "ddpmon.report.summary",
    ): "rank 0 logs the run's summary, the doctor's view of its history, at the end of the run",
}
"""Imports from the rank wing into the readers, each with its reason."""


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "vendor" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports, at the top, in functions or under TYPE_CHECKING."""
    path, package = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return found


IMPORTS = {name: _imports(name) for name in MODULES}


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _ours(imported: set[str]) -> set[str]:
    return {m for m in imported if m in MODULES}


def test_only_the_face_imports_the_rank_wing() -> None:
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        for t in _ours(ts)
        if _within(t, RANK) and not _within(m, RANK) and not (m in FACES or _within(m, FACES[1:]))
    )
    assert not crossings, crossings


def test_torch_is_imported_inside_the_rank_wing_alone() -> None:
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        for t in ts
        if t.split(".")[0] == "torch" and not _within(m, RANK) and m not in TORCH_OUTSIDE_RANK
    )
    assert not crossings, crossings


def test_the_leaves_import_only_leaves() -> None:
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if _within(m, LEAVES)
        for t in _ours(ts)
        if t != "ddpmon" and not _within(t, LEAVES)
    )
    assert not crossings, crossings


def test_the_daemon_is_a_runtime_of_its_own() -> None:
    """It stands on the leaves alone, and no reader leans on it (``doctor --from`` reads
    its routes over HTTP, through ``remote/daemons.py``)."""
    assert _within("ddpmon.daemon.node", DAEMON) and "ddpmon.daemon.node" in MODULES
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if _within(m, DAEMON)
        for t in _ours(ts)
        if t != "ddpmon" and not _within(t, (DAEMON, *LEAVES))
    )
    crossings += sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if not _within(m, DAEMON) and m != "ddpmon.cli.daemon"
        for t in _ours(ts)
        if _within(t, DAEMON)
    )
    assert not crossings, crossings


def test_the_package_imports_no_tool() -> None:
    crossings = sorted(
        f"{m} imports {t}" for m, ts in IMPORTS.items() for t in ts if t.split(".")[0] == "tools"
    )
    assert not crossings, crossings


def test_the_on_disk_contract_imports_no_reader_and_no_rank_code() -> None:
    allowed = (
        "ddpmon.state",
        "ddpmon.errors",
        "ddpmon.fuses",
        "ddpmon.frames",
        "ddpmon.collectors.host",
    )
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if _within(m, "ddpmon.state")
        for t in _ours(ts)
        if not _within(t, allowed)
    )
    assert not crossings, crossings


def test_the_rank_wing_reads_nothing_offline_but_what_is_named() -> None:
    crossings = sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if _within(m, RANK)
        for t in _ours(ts)
        if t != "ddpmon" and not _within(t, (RANK, *LEAVES)) and (m, t) not in RANK_READS
    )
    assert not crossings, crossings
    for (m, t), why in RANK_READS.items():  # a named exception that no longer exists goes
        assert t in IMPORTS[m], f"{m} no longer imports {t} ({why}): drop it from RANK_READS"


def test_no_import_circle() -> None:
    graph = {m: _ours(ts) - {m} for m, ts in IMPORTS.items()}
    circles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    # a package's __init__ importing its own modules is no circle unless they import it back
    assert not circles, circles


def test_the_rules_see_a_crossing() -> None:
    """The reader finds relative, lazy and aliased imports (what the rules above stand on)."""
    assert "torch" in IMPORTS["ddpmon.rank.monitor"] or any(
        t.startswith("torch.") for t in IMPORTS["ddpmon.rank.monitor"]
    )
    assert "ddpmon.rank.recorder" in IMPORTS["ddpmon.rank.monitor"]
    assert "ddpmon.rank.monitor" in IMPORTS["ddpmon"]  # lazily, in a function
