"""Finding the node daemons: a file of addresses (``--from-file``), and which of Prometheus'
targets are daemons and at what address (``--prometheus``; against a real Prometheus:
tests/integration/test_prometheus_discovery.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpmon.cli import build_parser, main
from ddpmon.errors import DiscoveryError
from ddpmon.remote.discovery import (
    DAEMON_JOBS,
    daemon_address,
    read_address_file,
    scrape_job_matches,
)


def test_an_address_file_is_one_address_a_line(tmp_path: Path) -> None:
    path = tmp_path / "daemons.txt"
    path.write_text(
        "# the job's nodes\n\nnode1:9490\n  node2:9490   # rack 3\nhttps://node3:9490\n\n[::1]:9490\n"
    )
    assert read_address_file(str(path)) == [
        "node1:9490",
        "node2:9490",
        "https://node3:9490",
        "[::1]:9490",
    ]


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "node1:9490\n# fine\nnode2\n",
            "line 3: 'node2' is not a daemon's address: expected HOST:PORT of a node daemon",
        ),
        ("node1:9490 node2:9490\n", "line 1: 'node1:9490 node2:9490' is not a daemon's address"),
        (
            "http://node1:9490/state\n",
            "line 1: 'http://node1:9490/state' is not a daemon's address: expected HOST:PORT "
            "alone, without a path (/state)",
        ),
        (
            "https://doctor:s3cret@node1:9490\n",
            "line 1: 'https://node1:9490' is not a daemon's address: it holds credentials",
        ),
        ("# nothing yet\n\n", "holds no address; write one daemon a line, HOST:PORT"),
    ],
)
def test_a_bad_line_is_named_by_its_number(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "daemons.txt"
    path.write_text(text)
    with pytest.raises(DiscoveryError) as caught:
        read_address_file(str(path))
    assert f"--from-file {path}" in str(caught.value) and said in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_a_missing_file_is_said(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="cannot be read .No such file or directory"):
        read_address_file(str(tmp_path / "nowhere.txt"))


def test_the_doctor_says_a_bad_file_and_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "daemons.txt"
    path.write_text("node1:9490\nnode2:http\n")
    with pytest.raises(SystemExit) as done:
        main(["doctor", "--from-file", str(path)])
    assert done.value.code == 2
    assert (
        f"ddpmon doctor: --from-file {path}, line 2: 'node2:http' is not a daemon's address"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "job, pool, daemon",
    [
        ("ddpmon-daemons", "ddpmon-daemons", True),  # deploy/prometheus/prometheus.yml
        ("ddpmon-daemon", "ddpmon-daemon", True),  # docs/daemon.md's static example
        (
            "ddpmon/ddpmon-daemon",
            "podMonitor/ddpmon/ddpmon-daemon/0",
            True,
        ),  # the shipped PodMonitor
        ("ddpmon-ranks", "ddpmon-ranks", False),
        ("node", "node", False),
        ("ddpmon/ddpmon-ranks", "podMonitor/ddpmon/ddpmon-ranks/0", False),
        ("ddpmon-daemons-old", "ddpmon-daemons-old", False),
    ],
)
def test_the_default_jobs_are_ddpmons_own(job: str, pool: str, daemon: bool) -> None:
    assert scrape_job_matches(job, pool, DAEMON_JOBS) is daemon


def test_a_chosen_job_is_its_label_or_its_pool() -> None:
    assert scrape_job_matches("gpu-nodes", "gpu-nodes", ["gpu-nodes"])
    assert scrape_job_matches(
        "monitoring/node", "podMonitor/monitoring/node/0", ["podMonitor/monitoring/node/0"]
    )
    assert not scrape_job_matches("gpu-nodes", "gpu-nodes", ["gpu"])


@pytest.mark.parametrize(
    "scrape_url, address",
    [
        ("http://10.0.0.7:9490/metrics", "10.0.0.7:9490"),
        ("https://node1:9490/metrics?x=1", "https://node1:9490"),
        ("http://[fd00::7]:9490/metrics", "[fd00::7]:9490"),
        ("https://node1/metrics", "https://node1:443"),
        ("http://node1/metrics", "node1:80"),
    ],
)
def test_a_targets_address_is_as_from_takes_it(scrape_url: str, address: str) -> None:
    assert daemon_address(scrape_url) == address


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["--prometheus-job", "x"],
            "--prometheus-job and --prometheus-http-config need --prometheus URL",
        ),
        (
            ["--prometheus", "http://user:pw@prom:9090"],
            "--prometheus 'http://prom:9090' is not valid: it holds "
            "credentials (user:password@): an address is printed, logged and "
            "seen in process lists; put them in an http_config file's "
            "basic_auth (--prometheus-http-config FILE)",
        ),
        (
            ["--prometheus", "prom:9090?x=1"],
            "--prometheus 'prom:9090?x=1' is not valid: expected HOST:PORT alone",
        ),
        (
            ["--prometheus", "http://prom:9090", "--prometheus-http-config", "/nowhere.yml"],
            "--prometheus-http-config /nowhere.yml: cannot be read",
        ),
    ],
)
def test_bad_discovery_options_are_usage_errors(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["doctor"], ["report"], ["compare", "a@", "b@"]):
        with pytest.raises(SystemExit) as done:
            main([*command, *argv])
        err = capsys.readouterr().err
        assert done.value.code == 2 and f"ddpmon {command[0]}: {said}" in err and "pw" not in err


def test_a_run_of_compare_on_found_daemons_needs_some(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["compare", "a@", "b@"])
    assert done.value.code == 2
    assert (
        "a@: names no daemon: write HOST:PORT[,HOST:PORT...] after the @, or find them with --from"
        in capsys.readouterr().err
    )


def test_every_reader_of_daemons_takes_the_same_options() -> None:
    parser = build_parser()
    for command in (["doctor"], ["report"], ["compare", "a", "b"]):
        args = parser.parse_args(
            [
                *command,
                "--from-file",
                "f",
                "--prometheus",
                "http://p:9090",
                "--prometheus-job",
                "j",
                "--prometheus-job",
                "k",
            ]
        )
        assert (args.from_file, args.prometheus, args.prometheus_job) == (
            ["f"],
            "http://p:9090",
            ["j", "k"],
        )
