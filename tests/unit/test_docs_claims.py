"""Claims the docs and docstrings make about the code, checked against it: the options
attach's docstring lists, the bucket-timing modes each description names, the parts that
count ``ddpmon_internal_errors_total``, the defaults the command line's help gives, the exit
codes, and the number of series a rank serves."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

import ddpmon
from ddpmon.cli import build_parser, exits
from ddpmon.config import BUCKET_TIMING_MODES, Config, default_state_root

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddpmon"


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _attribute_docs(path: Path, cls: str) -> dict[str, str]:
    """The docstring under each field of class ``cls`` in ``path``."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for field, doc in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(field.target, ast.Name)
        ):
            out[field.target.id] = str(doc.value.value)
    return out


def test_attach_lists_every_option_and_says_which_has_no_variable() -> None:
    doc = " ".join((ddpmon.attach.__doc__ or "").split())
    listed = re.search(r"\): (.*)\.$", doc)
    assert listed is not None, doc
    assert listed.group(1).split(", ") == [f.name for f in dataclasses.fields(Config)]
    assert "but comm_state" in doc  # an object: no DDPMON_COMM_STATE
    assert "DDPMON_COMM_STATE" in _attribute_docs(PACKAGE / "config.py", "Config")["comm_state"]


def test_every_description_of_bucket_timing_names_every_mode() -> None:
    config = _attribute_docs(PACKAGE / "config.py", "Config")["bucket_timing"]
    source = _attribute_docs(PACKAGE / "rank" / "timing" / "policy.py", "Plan")["source"]
    row = next(
        line
        for line in _doc("configuration.md").splitlines()
        if line.startswith("| `bucket_timing`")
    )
    for mode in BUCKET_TIMING_MODES:
        assert f"``{mode}``" in config, f"Config.bucket_timing's docstring omits {mode}"
        assert f"`{mode}`" in row, f"configuration.md's bucket_timing row omits {mode}"
        if mode != "auto":  # a plan has resolved auto
            assert f"``{mode}``" in source, f"Plan.source's docstring omits {mode}"


def _failing_parts() -> set[str]:
    """The ``part`` label values a rank can count in ddpmon_internal_errors_total: its
    fuses that report to the monitor, and the parts that record an error themselves."""
    parts: set[str] = set()
    for path in (PACKAGE / "rank").rglob("*.py"):
        text = path.read_text()
        parts.update(re.findall(r'Fuse\(\s*"(\w+)",\s*self\._part_failed', text))
        parts.update(re.findall(r'record_error\(\s*"(\w+)"', text))
        for names in re.findall(
            r"Fuse\(name, self\._part_failed\)\s*for name in \(([^)]*)\)", text
        ):
            parts.update(re.findall(r'"(\w+)"', names))
    return parts


def test_configuration_names_every_part_that_can_fail() -> None:
    text = " ".join(_doc("configuration.md").split())
    said = re.search(r"`ddpmon_internal_errors_total\{part\}` counts it: ([^)]*)\)", text)
    assert said is not None
    named = set(re.findall(r"`(\w+)`", said.group(1)))
    parts = _failing_parts()
    assert {"bucket_timing", "step_hooks", "capture", "faulthandler"} <= parts  # the reader works
    assert named == parts, (sorted(parts - named), sorted(named - parts))


def _helps(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _helps(sub)
        elif action.help:
            out.append(action.help)
    return out


def test_the_commands_name_the_default_state_root_as_it_is() -> None:
    helps = _helps(build_parser())
    vague = [h for h in helps if re.search(r"<tmp>/ddpmon(?!-<uid>)", h)]
    assert vague == [], "say <tmp>/ddpmon-<uid>, or default_state_root(), the real one"
    job = next(h for h in helps if h.startswith("the job to diagnose"))
    assert f"{default_state_root()}/JOB" in job


def test_the_exit_codes_are_the_one_table() -> None:
    rows = re.findall(r"^\| (\d+) \| ", _doc("doctor.md"), re.M)
    table = {v for k, v in vars(exits).items() if k.startswith("EXIT_")}
    assert {int(r) for r in rows[:4]} == {
        exits.EXIT_OK,
        exits.EXIT_PROBLEM,
        exits.EXIT_USAGE,
        exits.EXIT_FAILED,
    }
    # no command or the launcher writes a status of its own: every one comes from the table
    for path in [*(PACKAGE / "cli").glob("*.py"), PACKAGE / "launch.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            literal = None
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
                literal = node.value.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "exit"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                literal = node.args[0].value
            if type(literal) is int and path.name != "exits.py" and node_is_exit(node, path):
                raise AssertionError(
                    f"{path.name}:{node.lineno}: exit status {literal} not from exits.py"
                )
    assert exits.EXIT_INTERRUPTED in table and exits.EXIT_SCRIPT_FAILED in table


def node_is_exit(node: ast.AST, path: Path) -> bool:
    """A literal returned from a subcommand's ``run`` or passed to ``sys.exit``."""
    if isinstance(node, ast.Call):
        return True
    tree = ast.parse(path.read_text())
    runs = [
        f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ("run", "main")
    ]
    return any(node in list(ast.walk(f)) for f in runs)


def _series(buckets: int, mode: str, rank: int = 0) -> int:
    """Series a rank serves after 20 steps with ``buckets`` buckets (benchmarks/scrape.py's
    recorder)."""
    from ddpmon.rank.exporter import RankCollector
    from ddpmon.rank.recorder import BucketTiming, Recorder
    from ddpmon.state.schema import Identity

    rec = Recorder(
        Identity(rank=rank, local_rank=rank, world_size=8, host="h", job="j"), world_size=8
    )
    for i in range(buckets):
        rec.set_bucket_layout(i, 2**20, "float32", [f"l{i}.weight"])
    for s in range(20):
        rec.forward_started(s * 1.0)
        rec.forward_finished(s * 1.0 + 0.1)
        rec.backward_done(s * 1.0 + 0.5)
        rec.close_step(s * 1.0 + 0.9)
        rec.add_bucket_timings([BucketTiming(i, 0.2, 0.0, 0.004) for i in range(buckets)])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(rec, mode))
    body = generate_latest(registry).decode()
    return sum(1 for line in body.splitlines() if line and not line.startswith("#"))


def test_the_series_counts_the_docs_give_are_a_ranks() -> None:
    own, aggregated, per_bucket = (
        _series(1000, "off"),
        _series(1000, "aggregate"),
        _series(3, "per_bucket"),
    )
    per = (per_bucket - own) // 3
    metrics = " ".join(_doc("metrics.md").split())
    other = _series(0, "off", rank=1)  # rank 0 alone exports the job's goodput
    assert f"serves {other} series of its own before any bucket, rank 0 {own}" in metrics
    assert f"and {per} per bucket" in metrics
    assert (
        f"{own + 1000 * per:,} series per bucket, {aggregated} aggregated and {own} with" in metrics
    )
    performance = _doc("performance.md")
    assert f"| 1,000 | off | 0.7 ms | {own} | {own * 1024:,} |" in performance
    assert f"| 1,000 | aggregate | 3.3 ms | {aggregated} | {aggregated * 1024:,} |" in performance
    assert f"Rank 0 (the benchmark's) has {own} series of its own, the other ranks {other}" in (
        " ".join(performance.split())
    )


MEASUREMENTS_AND_NOTES = {
    "performance.md",
    "doctor-accuracy.md",
    "design-notes.md",
    "ARCHITECTURE.md",
}


def test_a_newcomer_finds_every_page_and_no_user_page_lists_tests() -> None:
    """docs/README.md links every page, the users' apart from the measurements and notes;
    the README links it; the test catalogues are in tests/README.md, not on a user's page."""
    index = (ROOT / "docs" / "README.md").read_text()
    users, _, rest = index.partition("## Measurements and design notes")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    linked_users = set(re.findall(r"\]\(([\w-]+\.md)\)", users))
    linked_rest = set(re.findall(r"\]\(([\w-]+\.md)\)", rest))
    assert linked_users == pages - MEASUREMENTS_AND_NOTES
    assert linked_rest == MEASUREMENTS_AND_NOTES
    assert "](docs/README.md)" in (ROOT / "README.md").read_text()
    for page in pages - MEASUREMENTS_AND_NOTES:
        assert not re.search(r"^## Tests$", _doc(page), re.M), (
            f"{page}: move its tests to tests/README.md"
        )
