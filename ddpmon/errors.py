"""Errors ddpmon raises to its caller. Each message says what was wrong and how to fix it."""

from __future__ import annotations


class DdpmonError(Exception):
    """Base class of every error ddpmon raises on purpose."""


class ConfigError(DdpmonError, ValueError):
    """An option or a DDPMON_* variable has a value ddpmon cannot use."""

    def __init__(self, name: str, value: object, expected: str) -> None:
        self.name = name
        self.value = value
        super().__init__(f"{name}={value!r} is not valid: expected {expected}")


class AttachError(DdpmonError):
    """attach() was called on something it cannot monitor, or at the wrong time."""


class StateFileError(DdpmonError):
    """A rank's state file is missing, truncated or not ddpmon's."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class DiscoveryError(DdpmonError):
    """The node daemons could not be found (``--from-file``, ``--prometheus``): says where
    they were looked for and what to do."""
