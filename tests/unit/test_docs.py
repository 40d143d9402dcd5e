"""The docs name what the code has, and the code has nothing the docs leave out: metric
names (docs/metrics.md's table is generated from the catalog), options and their DDPMON_*
variables (docs/configuration.md), every command's flags; README's command examples parse,
and every relative link in README and docs/ leads to a file and heading that exist."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from ddpmon.cli import build_parser
from ddpmon.config import Config
from ddpmon.metrics import catalog
from tools import metrics_table as table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
METRICS_DOC = ROOT / table.DEFAULT  # docs/metrics.md
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "tests" / "README.md",
    ]
}
# where each command's flags are documented; the top-level ones and top's are in README
DOC_OF = {
    "": "README.md",
    "top": "README.md",
    "doctor": "docs/doctor.md",
    "daemon": "docs/daemon.md",
    "dashboards": "docs/dashboards.md",
    "run": "docs/integrations.md",
    "report": "docs/report.md",
    "compare": "docs/report.md",
    "capture": "docs/capture.md",
    "preflight": "docs/doctor.md",
    "set": "docs/configuration.md",
}
PASSTHROUGH = {"run", "preflight"}  # after their own flags come torchrun's (and the script's)


def test_the_metric_table_is_the_catalog() -> None:
    text = METRICS_DOC.read_text()
    assert table.replace(text) == text, (
        "regenerate it: make metrics-table (python -m tools.metrics_table)"
    )


def test_a_file_without_the_markers_is_refused_not_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="expected one"):
        table.replace(METRICS_DOC.read_text().replace(table.END, ""))
    monkeypatch.chdir(tmp_path)  # the default file is docs/metrics.md, from where it runs
    assert table.main([]) == 2 and table.main(["README.md"]) == 2


def test_every_metric_name_the_docs_use_exists() -> None:
    from ddpmon.doctor.rules import rank_notes

    known = catalog.series_names() | set(catalog.BY_NAME)
    known.add(rank_notes.ddpmon_part_off.__name__)  # a doctor finding's kind, not a metric
    for doc, text in DOCS.items():
        names = {
            n for n in re.findall(r"(?<![\w:])ddpmon_[a-z0-9_]+", text) if not n.endswith("_")
        }  # ddpmon_gpu_*: a prefix
        unknown = sorted(names - known)
        assert unknown == [], f"{doc} names metrics the catalog does not have"
        recorded = set(re.findall(r"\b[a-z_]+:ddpmon_[a-z0-9_]+:[a-z0-9_]+", text))
        assert recorded <= catalog.RECORD_NAMES, f"{doc} names records the rules do not have"


def _options_table() -> list[str]:
    section = CONFIGURATION_DOC.read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.M)


def test_the_options_table_is_exactly_the_config() -> None:
    assert sorted(_options_table()) == sorted(f.name for f in dataclasses.fields(Config))


def test_every_ddpmon_variable_the_docs_name_is_an_option() -> None:
    variables = {
        "DDPMON_" + f.name.upper() for f in dataclasses.fields(Config) if f.name != "comm_state"
    }
    for doc, text in DOCS.items():
        named = set(re.findall(r"\bDDPMON_[A-Z_]*[A-Z]\b", text))
        assert named <= variables, (
            f"{doc} names variables ddpmon does not read: {sorted(named - variables)}"
        )


def _flags(parser: argparse.ArgumentParser, command: str = "") -> dict[str, set[str]]:
    """Each command's flags (a command's own and its subcommands'), by command name."""
    out: dict[str, set[str]] = {command: set()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for cmd, flags in _flags(sub, name if not command else command).items():
                    out.setdefault(cmd, set()).update(flags)
        else:
            out[command].update(o for o in action.option_strings if o not in ("-h", "--help"))
    return out


FLAGS = _flags(build_parser())


# the flags every command takes (-v/--verbose) are documented once, with the top-level ones
SHARED = set.intersection(*FLAGS.values())


def test_every_flag_is_documented_where_its_command_is() -> None:
    assert set(FLAGS) == set(DOC_OF)
    assert SHARED >= {"-v", "--verbose"}
    for command, flags in FLAGS.items():
        text = DOCS[DOC_OF[command]]
        flags = flags - SHARED if command else flags
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
        assert missing == [], f"`ddpmon {command}` flags missing from {DOC_OF[command]}"


def test_every_flag_the_docs_give_a_command_exists() -> None:
    commands = "|".join(c for c in FLAGS if c and c not in PASSTHROUGH)
    for doc, text in DOCS.items():
        for line in text.splitlines():
            # the flags after `ddpmon CMD` up to the next command on the line are CMD's
            for command, rest in re.findall(
                rf"ddpmon ({commands})\b(.*?)(?=ddpmon (?:{commands})\b|$)", line
            ):
                unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)) - FLAGS[command]
                assert not unknown, (
                    f"{doc}: `ddpmon {command}` has no {sorted(unknown)}: {line.strip()}"
                )


def test_quickstart_shows_the_two_commands() -> None:
    quickstart = README.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert "make demo" in quickstart and "make test" in quickstart


def _code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks of a Markdown text."""
    return [
        line
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
        for line in block.splitlines()
    ]


def test_every_command_example_in_readme_parses() -> None:
    examples = [
        line.split(" #", 1)[0].strip() for line in _code_lines(README) if line.startswith("ddpmon ")
    ]
    assert {e.split()[1] for e in examples} >= set(FLAGS) - {""}, (
        "README gives every command an example"
    )
    for example in examples:
        argv = shlex.split(re.sub(r"<[a-z]+>", "job", example.replace("$(id -u)", "1000")))[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"README: `{example}` does not parse")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(
        r"^```.*?^```", "", text, flags=re.M | re.S
    )  # a `# comment` in a block is no heading
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M):
        slug, n = _slug(heading), 1
        while slug in out:  # a repeated heading gets -1, -2, ...
            slug, n = f"{_slug(heading)}-{n}", n + 1
        out.add(slug)
    return out


def test_every_relative_link_leads_somewhere() -> None:
    for doc, text in DOCS.items():
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / doc).parent / path if path else ROOT / doc
            assert file.exists(), f"{doc}: the link {target} leads to no file"
            if anchor:
                assert anchor in _anchors(file.read_text()), (
                    f"{doc}: the link {target} leads to no heading"
                )
