"""deploy/systemd and deploy/kubernetes stay in step with the daemon's command line, and the
PodMonitors are what the Prometheus Operator accepts (its CRD's schema, vendored)."""

from __future__ import annotations

import configparser
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from ddpmon.cli import build_parser
from ddpmon.cli.daemon import DEFAULT_PORT
from ddpmon.remote.discovery import DAEMON_JOBS, scrape_job_matches

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
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    pod = ds["spec"]["template"]["spec"]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.node_local and args.state_dir == "/run/ddpmon" and args.port == DEFAULT_PORT
    assert container["command"] == ["ddpmon"]
    assert (
        container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    )  # fails when sampling is stuck
    assert "nvidia.com/gpu" not in str(container.get("resources"))  # takes no GPU away from jobs
    (port,) = container["ports"]
    assert port["containerPort"] == DEFAULT_PORT and port["name"] == "metrics"
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    (mount,) = container["volumeMounts"]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    assert (
        mount["mountPath"] == volume["hostPath"]["path"] == args.state_dir
        and mount["readOnly"] is True
    )
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)


def test_network_policy_lets_only_prometheus_in() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/networkpolicy.yaml").read_text()))
    assert {d["kind"] for d in docs} == {"NetworkPolicy"}
    for policy in docs:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:  # every rule names its peers: nothing open to all
            assert rule["from"] and all(
                "namespaceSelector" in p or "podSelector" in p for p in rule["from"]
            )


PODMONITOR_SCHEMA = ROOT / "tests/fixtures/prometheus_operator/podmonitor-v1.schema.json"


def _strict(schema: object) -> object:
    """The CRD schema with unknown fields refused (as ``kubectl apply --validate=strict``):
    a misspelt key would otherwise be dropped by the API server without a word."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _podmonitors() -> dict[str, dict]:
    found = {}
    for path in sorted((ROOT / "deploy/kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PodMonitor":
                found[f"{path.name}:{doc['metadata']['name']}"] = doc
    return found


def test_the_podmonitors_fit_the_prometheus_operator_schema() -> None:
    validator = jsonschema.Draft202012Validator(_strict(json.loads(PODMONITOR_SCHEMA.read_text())))
    monitors = _podmonitors()
    assert set(monitors) == {"daemonset.yaml:ddpmon-daemon", "podmonitor.yaml:ddpmon-ranks"}
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1", name
        errors = [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(monitor)
        ]
        assert errors == [], name


def test_the_schema_check_refuses_a_misspelt_key() -> None:
    validator = jsonschema.Draft202012Validator(_strict(json.loads(PODMONITOR_SCHEMA.read_text())))
    monitor = _podmonitors()["daemonset.yaml:ddpmon-daemon"]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["honorlabels"] = endpoint.pop("honorLabels")
    with pytest.raises(jsonschema.ValidationError, match="honorlabels"):
        validator.validate(monitor)
    endpoint["honorLabels"], endpoint["interval"] = True, "15 seconds"  # not a Prometheus duration
    with pytest.raises(jsonschema.ValidationError, match="15 seconds"):
        validator.validate(monitor)


@pytest.mark.parametrize("namespace", ["ddpmon", "monitoring"])
def test_doctor_prometheus_finds_the_daemons_podmonitor_by_default(namespace: str) -> None:
    """The operator names a PodMonitor's scrape job NAMESPACE/NAME: the doctor's default
    rule finds the shipped one in whatever namespace it is applied."""
    monitor = _podmonitors()["daemonset.yaml:ddpmon-daemon"]
    name = monitor["metadata"]["name"]
    assert scrape_job_matches(
        f"{namespace}/{name}", f"podMonitor/{namespace}/{name}/0", DAEMON_JOBS
    )
    ranks = _podmonitors()["podmonitor.yaml:ddpmon-ranks"]["metadata"]["name"]
    assert not scrape_job_matches(
        f"{namespace}/{ranks}", f"podMonitor/{namespace}/{ranks}/0", DAEMON_JOBS
    )
