"""TLS and basic auth in the Prometheus ecosystem's own formats, so that a platform engineer
writes nothing new: servers (the node daemon, a rank's endpoint) read exporter-toolkit's web
config file, as node_exporter's ``--web.config.file`` does; clients (``doctor``, ``report``
and ``compare`` ``--from``) read Prometheus' ``http_config``, as promtool's
``--http.config.file`` does. Fields ddpmon does not support are refused by name, never
silently ignored; relative file names are read from the config file's directory, as both
do. Torch-free.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import hashlib
import http.client
import os
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import DdpmonError

CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,  # (Python cannot ask without verifying: verified when given)
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


class WebConfigError(DdpmonError):
    """A web config or http_config file ddpmon cannot use; says which file, what and the fix."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


# -- reading either file -------------------------------------------------------------------------


def _load(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise WebConfigError(path, f"cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(path, f"is not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise WebConfigError(path, "is not a YAML mapping of settings")
    return data


def _section(
    path: str,
    data: Mapping[str, Any],
    where: str,
    known: tuple[str, ...],
    unsupported: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``data`` checked: a mapping whose keys ddpmon reads (``known``); a key of the format
    that ddpmon does not implement, or a misspelt one, is refused by name."""
    if not isinstance(data, dict):
        raise WebConfigError(path, f"{where} is not a mapping")
    for key in data:
        if key in unsupported:
            raise WebConfigError(
                path,
                f"{where}{key} is not supported by ddpmon; remove it (supported: "
                f"{', '.join(known)})",
            )
        if key not in known:
            raise WebConfigError(
                path,
                f"{where}{key!r} is not a setting of this file (expected one of "
                f"{', '.join(known)})",
            )
    return dict(data)


def _file(path: str, value: Any, name: str) -> str:
    """A file named in the config: relative to the config file's directory; it must exist."""
    if not isinstance(value, str) or not value:
        raise WebConfigError(path, f"{name} must be a file name, not {value!r}")
    found = os.path.join(os.path.dirname(os.path.abspath(path)), value)
    if not os.path.isfile(found):
        raise WebConfigError(path, f"{name} {value!r} does not exist ({found})")
    return found


def _text(path: str, value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise WebConfigError(path, f"{name} must be a string")
    return value


def _secret_file(path: str, value: Any, name: str) -> str:
    """The first line of a secret file (as Prometheus reads ``password_file``)."""
    found = _file(path, value, name)
    try:
        with open(found, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise WebConfigError(
            path, f"{name} {found} cannot be read ({exc.strerror or exc})"
        ) from None


def _tls_version(path: str, tls: Mapping[str, Any], key: str) -> ssl.TLSVersion | None:
    if key not in tls:
        return None
    if tls[key] not in TLS_VERSIONS:
        raise WebConfigError(
            path,
            f"tls config's {key}={tls[key]!r} is not valid: expected one of "
            f"{', '.join(TLS_VERSIONS)}",
        )
    return TLS_VERSIONS[tls[key]]


# -- servers: exporter-toolkit's web config ---------------------------------------------------------

_DUMMY_HASH = (
    b"$2b$10$" + b"." * 53
)  # compared against when the user is unknown: the same time either way


@dataclass
class WebConfig:
    """What a server reads from exporter-toolkit's web config file: TLS (``ssl``, None for
    plain HTTP) and basic auth users (bcrypt hashes; none: every request is let in)."""

    path: str
    ssl: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    _verified: collections.OrderedDict[bytes, bool] = field(
        default_factory=collections.OrderedDict, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def guarded(self) -> bool:
        """Whether a request must prove who it is (basic auth, or a verified client certificate)."""
        return bool(self.users) or (
            self.ssl is not None and self.ssl.verify_mode == ssl.CERT_REQUIRED
        )

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header's basic credentials are a user's. A bcrypt check
        costs tens of milliseconds, so a credential that passed is remembered (by its
        SHA-256, never in clear) and Prometheus' scrapes every few seconds cost one each.
        Call it off the event loop."""
        if not self.users:
            return True
        user, password = _basic(authorization)
        if user is None or password is None:
            return False
        key = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        with self._lock:
            if key in self._verified:
                self._verified.move_to_end(key)
                return True
        import bcrypt

        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password.encode(), hashed or _DUMMY_HASH) and hashed is not None
        except ValueError:  # a hash bcrypt cannot read (checked at load: not reached)
            ok = False
        if ok:
            with self._lock:
                self._verified[key] = True
                while len(self._verified) > 256:
                    self._verified.popitem(last=False)
        return ok


def _basic(authorization: str | None) -> tuple[str | None, str | None]:
    if not authorization or not authorization[:6].lower() == "basic ":
        return None, None
    try:
        user, _, password = (
            base64.b64decode(authorization[6:].strip(), validate=True).decode().partition(":")
        )
    except (binascii.Error, UnicodeDecodeError):
        return None, None
    return user, password


def load_web_config(path: str) -> WebConfig:
    """Read exporter-toolkit's web config file (``tls_server_config``, ``basic_auth_users``)."""
    data = _section(
        path, _load(path), "", ("tls_server_config", "basic_auth_users", "http_server_config")
    )
    config = WebConfig(path)
    if data.get("http_server_config"):
        _section(path, data["http_server_config"], "http_server_config.", (), ("http2", "headers"))
    tls = data.get("tls_server_config")
    if tls:
        tls = _section(
            path,
            tls,
            "tls_server_config.",
            (
                "cert_file",
                "key_file",
                "client_auth_type",
                "client_ca_file",
                "min_version",
                "max_version",
            ),
            (
                "cert",
                "key",
                "cipher_suites",
                "curve_preferences",
                "prefer_server_cipher_suites",
                "client_allowed_sans",
            ),
        )
        if "cert_file" not in tls or "key_file" not in tls:
            raise WebConfigError(path, "tls_server_config needs both cert_file and key_file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = _tls_version(path, tls, "min_version") or ssl.TLSVersion.TLSv1_2
        if "max_version" in tls:
            context.maximum_version = (
                _tls_version(path, tls, "max_version") or ssl.TLSVersion.MAXIMUM_SUPPORTED
            )
        try:
            context.load_cert_chain(
                _file(path, tls["cert_file"], "cert_file"), _file(path, tls["key_file"], "key_file")
            )
        except ssl.SSLError as exc:
            raise WebConfigError(
                path, f"cert_file and key_file are not a certificate and its key ({exc})"
            ) from None
        auth_type = tls.get("client_auth_type", "NoClientCert")
        if auth_type not in CLIENT_AUTH_TYPES:
            raise WebConfigError(
                path,
                f"client_auth_type={auth_type!r} is not valid: expected one of "
                f"{', '.join(CLIENT_AUTH_TYPES)}",
            )
        if auth_type != "NoClientCert":
            if "client_ca_file" not in tls:
                raise WebConfigError(
                    path,
                    f"client_auth_type {auth_type} needs client_ca_file, the CA that "
                    "signs the clients' certificates",
                )
            context.load_verify_locations(_file(path, tls["client_ca_file"], "client_ca_file"))
            context.verify_mode = CLIENT_AUTH_TYPES[auth_type]
        config.ssl = context
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise WebConfigError(
            path, "basic_auth_users is not a mapping of user names to bcrypt hashes"
        )
    for user, hashed in users.items():
        text = str(hashed)
        if not text.startswith(("$2a$", "$2b$", "$2y$")) or len(text) != 60:
            raise WebConfigError(
                path,
                f"basic_auth_users.{user} is not a bcrypt hash (make one with "
                "`htpasswd -nBC 10 '' | tr -d ':\\n'`, as for node_exporter)",
            )
        config.users[str(user)] = text.encode()
    return config


# -- clients: Prometheus' http_config -----------------------------------------------------------------


@dataclass
class HttpConfig:
    """What a client reads from Prometheus' http_config: TLS for https (``ssl``) and the
    ``Authorization`` header it sends (None: none)."""

    path: str | None = None
    ssl: ssl.SSLContext | None = None
    server_name: str | None = None
    authorization: str | None = field(default=None, repr=False)

    def open(self, url: str, timeout: float, data: bytes | None = None) -> Any:
        """``urllib.request.urlopen`` of ``url`` with this TLS and these credentials (a POST
        of the JSON ``data`` when given)."""
        request = urllib.request.Request(url, data=data)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.authorization:
            request.add_unredirected_header("Authorization", self.authorization)
        handlers: list[Any] = []
        if self.ssl is not None:
            handlers.append(
                _NamedHttpsHandler(self.ssl, self.server_name)
                if self.server_name
                else urllib.request.HTTPSHandler(context=self.ssl)
            )
        return urllib.request.build_opener(*handlers).open(request, timeout=timeout)


class _NamedHttpsHandler(urllib.request.HTTPSHandler):
    """https whose certificate is checked against ``server_name``, not the URL's host."""

    def __init__(self, context: ssl.SSLContext, server_name: str) -> None:
        super().__init__(context=context)
        self._ssl, self._server_name = context, server_name

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(
            functools.partial(_NamedConnection, server_name=self._server_name),
            req,
            context=self._ssl,
        )


class _NamedConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, server_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


def load_http_config(path: str | None) -> HttpConfig:
    """Read Prometheus' http_config (``basic_auth``, ``authorization``, ``tls_config``);
    None: plain defaults (https checked against the system's CAs)."""
    if path is None:
        return HttpConfig()
    data = _section(
        path,
        _load(path),
        "",
        ("basic_auth", "authorization", "tls_config", "follow_redirects", "enable_http2"),
        (
            "oauth2",
            "bearer_token",
            "bearer_token_file",
            "proxy_url",
            "no_proxy",
            "proxy_from_environment",
            "proxy_connect_header",
            "http_headers",
        ),
    )
    config = HttpConfig(path)
    basic = data.get("basic_auth")
    if basic:
        basic = _section(
            path, basic, "basic_auth.", ("username", "username_file", "password", "password_file")
        )
        user = (
            _secret_file(path, basic["username_file"], "basic_auth.username_file")
            if "username_file" in basic
            else _text(path, basic.get("username", ""), "basic_auth.username")
        )
        if "password" in basic and "password_file" in basic:
            raise WebConfigError(path, "basic_auth has both password and password_file: keep one")
        password = (
            _secret_file(path, basic["password_file"], "basic_auth.password_file")
            if "password_file" in basic
            else _text(path, basic.get("password", ""), "basic_auth.password")
        )
        config.authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    auth = data.get("authorization")
    if auth:
        if config.authorization:
            raise WebConfigError(path, "basic_auth and authorization are both set: keep one")
        auth = _section(path, auth, "authorization.", ("type", "credentials", "credentials_file"))
        secret = (
            _secret_file(path, auth["credentials_file"], "authorization.credentials_file")
            if "credentials_file" in auth
            else _text(path, auth.get("credentials", ""), "authorization.credentials")
        )
        config.authorization = f"{auth.get('type', 'Bearer')} {secret}"
    tls = _section(
        path,
        data.get("tls_config") or {},
        "tls_config.",
        (
            "ca_file",
            "cert_file",
            "key_file",
            "server_name",
            "insecure_skip_verify",
            "min_version",
            "max_version",
        ),
        ("ca", "cert", "key"),
    )
    context = ssl.create_default_context(
        cafile=_file(path, tls["ca_file"], "tls_config.ca_file") if "ca_file" in tls else None
    )
    if "cert_file" in tls or "key_file" in tls:
        if "cert_file" not in tls or "key_file" not in tls:
            raise WebConfigError(
                path, "tls_config needs both cert_file and key_file for a client certificate"
            )
        context.load_cert_chain(
            _file(path, tls["cert_file"], "tls_config.cert_file"),
            _file(path, tls["key_file"], "tls_config.key_file"),
        )
    if tls.get("insecure_skip_verify"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    for key in ("min_version", "max_version"):
        version = _tls_version(path, tls, key)
        if version is not None:
            setattr(
                context, "minimum_version" if key == "min_version" else "maximum_version", version
            )
    config.ssl = context
    config.server_name = tls.get("server_name") or None
    return config
