"""The two formats of ddpmon/webconfig.py, read from real files with real certificates (made
by openssl): exporter-toolkit's web config (servers) and Prometheus' http_config (clients).
Every mistake is refused with the file, the setting and what is expected."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

import pytest

from ddpmon.webconfig import WebConfigError, load_http_config, load_web_config
from tests.support.commands import run_doctor
from tests.support.tls import Pki, bcrypt_hash, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_a_web_config_as_node_exporter_reads_it(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    for p in (pki.server_cert, pki.server_key, pki.ca):
        (tmp_path / "tls" / p.name).write_bytes(p.read_bytes())
    config = load_web_config(
        write(
            tmp_path / "web.yml",
            f"""
tls_server_config:
  cert_file: tls/server.crt      # relative to this file, as exporter-toolkit reads it
  key_file: tls/server.key
  client_auth_type: VerifyClientCertIfGiven
  client_ca_file: tls/ca.crt
  min_version: TLS12
basic_auth_users:
  prometheus: {bcrypt_hash("s3cret")}
""",
        )
    )
    assert config.ssl is not None and config.ssl.verify_mode == ssl.CERT_OPTIONAL and config.guarded
    assert config.allows(basic("prometheus", "s3cret"))
    assert config.allows(basic("prometheus", "s3cret"))  # (remembered: no second bcrypt)
    assert not config.allows(basic("prometheus", "wrong"))
    assert not config.allows(basic("nobody", "s3cret")) and not config.allows(None)
    assert not config.allows("Bearer s3cret") and not config.allows("Basic !!!")
    plain = load_web_config(write(tmp_path / "empty.yml", ""))
    assert plain.ssl is None and not plain.guarded and plain.allows(None)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "tls_server_config:\n  cert_file: server.crt\n",
            "tls_server_config needs both cert_file and key_file",
        ),
        (
            "tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n",
            "cert_file 'nope.crt' does not exist",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  cipher_suites: [x]\n",
            "tls_server_config.cipher_suites is not supported by ddpmon",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: Maybe\n",
            "client_auth_type='Maybe' is not valid: expected one of NoClientCert",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "needs client_ca_file",
        ),
        ("tls_server_confg: {}\n", "'tls_server_confg' is not a setting of this file"),
        (
            "basic_auth_users:\n  admin: hunter2\n",
            "basic_auth_users.admin is not a bcrypt hash (make one with `htpasswd",
        ),
        ("- a\n- list\n", "is not a YAML mapping"),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_a_bad_web_config_is_refused_with_the_reason(
    pki: Pki, tmp_path: Path, text: str, reason: str
) -> None:
    for p in (pki.server_cert, pki.server_key):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    path = write(tmp_path / "web.yml", text)
    with pytest.raises(WebConfigError) as got:
        load_web_config(path)
    assert str(got.value).startswith(f"{path}: ") and reason in str(got.value), got.value
    assert "hunter2" not in str(got.value)


def test_an_http_config_as_promtool_reads_it(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "password").write_text("s3cret\n")
    config = load_http_config(
        write(
            tmp_path / "http.yml",
            f"""
basic_auth:
  username: doctor
  password_file: password
tls_config:
  ca_file: {pki.ca}
  cert_file: {pki.client_cert}
  key_file: {pki.client_key}
  server_name: ddpmon-node
follow_redirects: true
""",
        )
    )
    assert config.authorization == basic("doctor", "s3cret") and config.server_name == "ddpmon-node"
    assert config.ssl is not None and config.ssl.verify_mode == ssl.CERT_REQUIRED
    assert "s3cret" not in repr(config)
    bearer = load_http_config(
        write(tmp_path / "bearer.yml", "authorization:\n  credentials: t0ken\n")
    )
    assert bearer.authorization == "Bearer t0ken"
    loose = load_http_config(
        write(tmp_path / "loose.yml", "tls_config:\n  insecure_skip_verify: true\n")
    )
    assert (
        loose.ssl is not None
        and loose.ssl.verify_mode == ssl.CERT_NONE
        and loose.authorization is None
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "basic_auth:\n  username: a\n  password: b\n  password_file: p\n",
            "both password and password_file",
        ),
        (
            "basic_auth:\n  username: a\n  pasword: b\n",
            "basic_auth.'pasword' is not a setting of this file",
        ),
        ("bearer_token: x\n", "bearer_token is not supported by ddpmon"),
        (
            "tls_config:\n  ca_file: missing.crt\n",
            "tls_config.ca_file 'missing.crt' does not exist",
        ),
        ("tls_config:\n  min_version: TLS99\n", "min_version='TLS99' is not valid"),
        (
            "basic_auth:\n  username: a\n  password: b\nauthorization:\n  credentials: c\n",
            "keep one",
        ),
    ],
)
def test_a_bad_http_config_is_refused_with_the_reason(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = write(tmp_path / "http.yml", text)
    with pytest.raises(WebConfigError) as got:
        load_http_config(path)
    assert str(got.value).startswith(f"{path}: ") and reason in str(got.value), got.value


def test_the_commands_refuse_credentials_in_an_address_without_repeating_them(
    tmp_path: Path,
) -> None:
    done = run_doctor("--from", "https://doctor:hunter2@127.0.0.1:9490", "--json")
    assert done.returncode == 2
    assert "hunter2" not in done.stdout + done.stderr
    assert (
        "--from 'https://127.0.0.1:9490' is not valid: it holds credentials (user:password@)"
        in done.stderr
    )
    assert "--http-config" in done.stderr
    bad = write(tmp_path / "http.yml", "basic_auth:\n  usernme: x\n")
    done = run_doctor("--from", "127.0.0.1:9490", "--http-config", bad)
    assert (
        done.returncode == 2
        and f"--http-config {bad}: basic_auth.'usernme' is not a setting" in done.stderr
    )
