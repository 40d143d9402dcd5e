"""deploy/systemd and deploy/kubernetes stay in step with the daemon's command line."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import yaml

from ddpmon.cli import build_parser
from ddpmon.cli.daemon import DEFAULT_PORT

ROOT = Path(__file__).resolve().parents[2]


def test_systemd_unit_runs_a_valid_daemon_command() -> None:
    """(systemd's own check of the unit: tests/integration/test_systemd_unit.py.)"""
    unit = ROOT / "deploy/systemd/ddpmon-daemon.service"
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment]
    parser.read_string(unit.read_text())
    service = parser["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/ddpmon") and argv[1] == "daemon"
    args = build_parser().parse_args(argv[1:])
    assert args.port == DEFAULT_PORT and args.state_dir == "/tmp/ddpmon-*"
    assert service["KillSignal"] == "SIGTERM" and service["PrivateTmp"] == "no"


def test_daemonset_and_service() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/daemonset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"DaemonSet", "Service", "PodMonitor"}
    ds, svc, monitor = kinds["DaemonSet"], kinds["Service"], kinds["PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.node_local and args.state_dir == "/run/ddpmon" and args.port == DEFAULT_PORT
    assert container["command"] == ["ddpmon"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"  # fails when sampling is stuck
    assert "nvidia.com/gpu" not in str(container.get("resources"))  # takes no GPU away from jobs
    (port,) = container["ports"]
    assert port["containerPort"] == DEFAULT_PORT and port["name"] == "metrics"
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    (mount,) = container["volumeMounts"]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    assert mount["mountPath"] == volume["hostPath"]["path"] == args.state_dir and mount["readOnly"] is True
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)


def test_network_policy_lets_only_prometheus_in() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/networkpolicy.yaml").read_text()))
    assert {d["kind"] for d in docs} == {"NetworkPolicy"}
    for policy in docs:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:  # every rule names its peers: nothing open to all
            assert rule["from"] and all("namespaceSelector" in p or "podSelector" in p for p in rule["from"])
