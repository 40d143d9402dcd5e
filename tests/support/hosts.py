"""Hosts made of Linux namespaces, for jobs that span nodes on one machine.

Each host is a network and UTS namespace (its own host name and addresses) held open by a
sleeping process, with its own TMPDIR, so its ranks and its daemon share nothing with the
other host but the network. A third namespace holds two bridges, the switches of two
networks: ``job`` (gloo, ``10.77.0.0/24``) and ``mgmt`` (the daemons and the doctor,
``10.77.1.0/24``), so the job's link can be cut while the daemons stay reachable. Every link
lives inside these namespaces: ending the holders removes them all.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support import harness

ROOT = Path(__file__).resolve().parents[2]
NETS = {"job": "10.77.0", "mgmt": "10.77.1"}
"""The two networks and their /24 prefixes; host i has address .(i + 1) on each."""
IFACE = {net: f"eth-{net}" for net in NETS}
"""The interface of each network inside a host (GLOO_SOCKET_IFNAME is ``eth-job``)."""
TOOLS = ("unshare", "nsenter", "ip", "hostname")
"""What hosts need; ``Host.shape`` needs ``tc`` too."""


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to make network and UTS namespaces"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH"
    probe = subprocess.run(
        [
            "unshare",
            "--net",
            "--uts",
            "sh",
            "-c",
            "hostname probe && ip link add br0 type bridge && ip link add v0 type veth peer name v1",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot make a namespace with a bridge and a veth pair: {probe.stderr.strip()}"
    return None


def _holder(*flags: str, hostname: str | None = None) -> subprocess.Popen:
    """A process that holds new namespaces open until it is killed; returned once it sleeps
    in them (before that, its /proc/PID/ns would be this process's own namespaces)."""
    setup = f"hostname {hostname} && " if hostname else ""
    proc = subprocess.Popen(
        ["unshare", *flags, "sh", "-c", f"{setup}ip link set lo up && exec sleep 3600"],
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                return proc
        except OSError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(
        f"unshare {' '.join(flags)} did not set up its namespaces (exit {proc.wait()})"
    )


class Host:
    """One host: its namespaces (through the holder's pid), name, addresses and TMPDIR."""

    def __init__(self, name: str, index: int, holder: subprocess.Popen, workdir: Path) -> None:
        self.name, self.index, self.holder = name, index, holder
        self.tmp = workdir / name / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def addr(self, net: str = "mgmt") -> str:
        return f"{NETS[net]}.{self.index + 1}"

    def enter(self) -> list[str]:
        pid = self.holder.pid
        return ["nsenter", f"--net=/proc/{pid}/ns/net", f"--uts=/proc/{pid}/ns/uts"]

    def env(self, **extra: str) -> dict[str, str]:
        """This environment on the host: its TMPDIR (so its default state root is its own),
        the checkout first on the import path, no state directory of the caller's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDPMON_")}
        env.update(
            TMPDIR=str(self.tmp),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            **extra,
        )
        return env

    def ip(self, *args: str) -> None:
        subprocess.run([*self.enter(), "ip", *args], check=True, capture_output=True, timeout=20)

    def shape(self, rate: str, net: str = "job") -> None:
        """Limit what this host sends on the network to ``rate`` (``tc``'s token bucket), as
        a slow NIC or a degraded link would."""
        subprocess.run(
            [*self.enter(), "tc", "qdisc", "add", "dev", IFACE[net], "root", "tbf", "rate", rate]
            + ["burst", "32kbit", "latency", "50ms"],
            check=True,
            capture_output=True,
            timeout=20,
        )

    def start(self, cmd: list[str], log: str, **env: str) -> subprocess.Popen:
        """Start ``cmd`` on this host (its own session), output in ``<host>/<log>.out|.err``."""
        base = self.tmp.parent
        with open(base / f"{log}.out", "w") as out, open(base / f"{log}.err", "w") as err:
            proc = subprocess.Popen(
                [*self.enter(), *cmd],
                cwd=ROOT,
                env=self.env(**env),
                start_new_session=True,
                stdout=out,
                stderr=err,
            )
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.enter(), *cmd],
            cwd=ROOT,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def kill_all(self) -> None:
        """SIGKILL every process started on this host (each one's whole session, and the
        ranks below it in sessions of their own)."""
        harness.stop(self.procs)

    def log(self, name: str) -> str:
        base = self.tmp.parent
        return "".join(
            f"--- {p.name}:\n{p.read_text()[-3000:]}\n"
            for p in sorted(base.glob(f"{name}*"))
            if p.is_file()
        )


class Cluster:
    """Hosts on two switched networks; a context manager that removes everything it made."""

    def __init__(self, workdir: Path, names: tuple[str, ...] = ("host-a", "host-b")) -> None:
        self.workdir, self.names = workdir, names
        self.hosts: list[Host] = []
        self.switch: subprocess.Popen | None = None

    def __enter__(self) -> Cluster:
        try:
            self.switch = _holder("--net")
            for i, name in enumerate(self.names):
                self.hosts.append(
                    Host(name, i, _holder("--net", "--uts", hostname=name), self.workdir)
                )
            for net in NETS:
                self._switch_ip("link", "add", f"br-{net}", "type", "bridge")
                self._switch_ip("link", "set", f"br-{net}", "up")
            for host in self.hosts:
                for net in NETS:
                    port = self.port(host, net)
                    self._switch_ip("link", "add", port, "type", "veth", "peer", "name", IFACE[net])
                    self._switch_ip("link", "set", IFACE[net], "netns", str(host.holder.pid))
                    self._switch_ip("link", "set", port, "master", f"br-{net}", "up")
                    host.ip("addr", "add", f"{host.addr(net)}/24", "dev", IFACE[net])
                    host.ip("link", "set", IFACE[net], "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.kill_all()
        for holder in [h.holder for h in self.hosts] + ([self.switch] if self.switch else []):
            holder.kill()
            holder.wait(10)

    @staticmethod
    def port(host: Host, net: str) -> str:
        return f"{net}{host.index}"

    def _switch_ip(self, *args: str) -> None:
        assert self.switch is not None
        subprocess.run(
            ["nsenter", f"--net=/proc/{self.switch.pid}/ns/net", "ip", *args],
            check=True,
            capture_output=True,
            timeout=20,
        )

    def cut(self, host: Host, net: str = "job") -> None:
        """Take the host's port off the network's bridge: its frames are dropped both ways
        while both ends stay up, so connections time out rather than fail."""
        self._switch_ip("link", "set", self.port(host, net), "nomaster")


DAEMON_AUTH = ("doctor", "two-hosts")
"""The daemons' basic auth user and password (``credentials``)."""


@functools.cache
def credentials() -> tuple[str, str]:
    """(web config, http_config): basic auth for the daemons, whose ``--serve-state`` on the
    hosts' addresses needs credentials, and the same user for the doctor and the report."""
    from tests.support.tls import bcrypt_hash

    directory = Path(tempfile.mkdtemp(prefix="ddpmon-hosts-auth-"))
    web, http = directory / "web.yml", directory / "http.yml"
    user, password = DAEMON_AUTH
    web.write_text(f"basic_auth_users:\n  {user}: {bcrypt_hash(password)}\n")
    http.write_text(f"basic_auth:\n  username: {user}\n  password: {password}\n")
    return str(web), str(http)


def start_daemon(host: Host, port: int = 9490) -> subprocess.Popen:
    """``ddpmon daemon --serve-state`` on the host, reading its default state roots (its
    TMPDIR), with basic auth (``credentials``); returns once it serves."""
    proc = host.start(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "daemon",
            "--port",
            str(port),
            "--bind",
            "0.0.0.0",
            "--serve-state",
            "--no-gpu",
            "--web-config-file",
            credentials()[0],
        ],
        "daemon",
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "serving http://" in (host.tmp.parent / "daemon.out").read_text():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"the daemon on {host.name} did not start:\n{host.log('daemon')}")


MASTER_PORT = "29500"


def start_job(
    cluster: Cluster, scenario: str, *args: str, per_host: int = 2, **env: str
) -> list[subprocess.Popen]:
    """``tests.hosts.worker SCENARIO ARGS`` on every host, ``per_host`` ranks each, numbered
    as torchrun numbers them (host i holds ranks i * per_host ...); rank order."""
    world = per_host * len(cluster.hosts)
    master = cluster.hosts[0].addr("job")
    procs = []
    for host in cluster.hosts:
        for local in range(per_host):
            rank = host.index * per_host + local
            procs.append(
                host.start(
                    [sys.executable, "-m", "tests.hosts.worker", scenario, *args],
                    f"rank-{rank}",
                    RANK=str(rank),
                    LOCAL_RANK=str(local),
                    GROUP_RANK=str(host.index),
                    WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(per_host),
                    MASTER_ADDR=master,
                    MASTER_PORT=MASTER_PORT,
                    GLOO_SOCKET_IFNAME=IFACE["job"],
                    **env,
                )
            )
    return procs


DAEMON_PORT = 9490
"""The port of each host's daemon (`start_daemon`)."""


def doctor(on: Host, *args: str) -> tuple[int, dict[str, Any], float]:
    """``ddpmon doctor ARGS --json --no-stacks`` on a host: exit code, report, seconds taken."""
    started = time.monotonic()
    done = on.run(
        [sys.executable, "-m", "ddpmon", "doctor", *args, "--json", "--no-stacks"], timeout=30
    )
    took = time.monotonic() - started
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout), took


def sources(*addresses: str) -> list[str]:
    """``--from`` each daemon, with the credentials their ``--serve-state`` asks for."""
    return [a for address in addresses for a in ("--from", f"{address}:{DAEMON_PORT}")] + [
        "--http-config",
        credentials()[1],
    ]


def finding(report: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert found, f"no {kind} finding in {json.dumps(report['findings'], indent=1)}"
    return found[0]
