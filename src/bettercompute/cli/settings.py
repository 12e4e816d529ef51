"""Where a command finds its server, credential, tenant and output format.

Why one place: every command takes ``--url``, ``--token``, ``--tenant`` and ``--output``, and
each may also come from the environment (``BETTER_COMPUTE_URL``, ``BETTER_COMPUTE_TOKEN``,
``BETTER_COMPUTE_TENANT``) or the config file (``$BETTER_COMPUTE_CONFIG``, else
``~/.config/better-compute/config.yaml``, keys ``url``, ``token``, ``tenant``). The rule is the
same for all of them: flag, then environment, then config file, then the default.

What this module must never do: print a token, or read a file other than the config file. A
config file that cannot be read is a usage error naming the file, never a traceback.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bettercompute.cli import client

DEFAULT_URL = "http://127.0.0.1:8080"
CONFIG_ENV = "BETTER_COMPUTE_CONFIG"
URL_ENV = "BETTER_COMPUTE_URL"
TOKEN_ENV = "BETTER_COMPUTE_TOKEN"
TENANT_ENV = "BETTER_COMPUTE_TENANT"
CONFIG_KEYS = ("url", "token", "tenant")


class Output(enum.StrEnum):
    TABLE = "table"
    #: The table with whole ids (a table shows each id's shortest unique start).
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"


@dataclass(frozen=True)
class Settings:
    url: str
    token: str | None
    tenant: str | None
    output: Output
    #: The config file that gave values, if one did.
    config_path: Path | None


def default_config_path(environ: Mapping[str, str]) -> tuple[Path, bool]:
    """The config file to read and whether the user named it explicitly."""
    named = environ.get(CONFIG_ENV)
    if named:
        return Path(named).expanduser(), True
    return Path.home() / ".config" / "better-compute" / "config.yaml", False


def load_config(path: Path, *, required: bool) -> dict[str, str]:
    """The config file's keys; an absent default file is empty, a named one must exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise client.Failure(
                f"config file {path} (from ${CONFIG_ENV}) does not exist",
                exit_code=client.EXIT_USAGE,
            ) from None
        return {}
    except OSError as e:
        raise client.Failure(
            f"cannot read config file {path}: {e.strerror or e}", exit_code=client.EXIT_USAGE
        ) from None
    try:
        loaded: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise client.Failure(
            f"config file {path} is not valid YAML: {_first_line(e)}",
            exit_code=client.EXIT_USAGE,
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise client.Failure(
            f"config file {path} must be a mapping with keys {', '.join(CONFIG_KEYS)}",
            exit_code=client.EXIT_USAGE,
        )
    config: dict[str, str] = {}
    for key, value in loaded.items():
        if key not in CONFIG_KEYS:
            raise client.Failure(
                f"config file {path}: unknown key {key!r} (known: {', '.join(CONFIG_KEYS)})",
                exit_code=client.EXIT_USAGE,
            )
        if not isinstance(value, str) or not value:
            raise client.Failure(
                f"config file {path}: {key} must be a non-empty string",
                exit_code=client.EXIT_USAGE,
            )
        config[key] = value
    return config


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def resolve(
    *,
    url: str | None,
    token: str | None,
    tenant: str | None,
    output: Output | None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Flags first, then the environment, then the config file, then the defaults."""
    env = os.environ if environ is None else environ
    path, named = default_config_path(env)
    config = load_config(path, required=named)

    def pick(flag: str | None, env_name: str, key: str) -> str | None:
        for value in (flag, env.get(env_name), config.get(key)):
            if value:
                return value
        return None

    return Settings(
        url=pick(url, URL_ENV, "url") or DEFAULT_URL,
        token=pick(token, TOKEN_ENV, "token"),
        tenant=pick(tenant, TENANT_ENV, "tenant"),
        output=output or Output.TABLE,
        config_path=path if config else None,
    )


def require_tenant(settings: Settings) -> str:
    """The tenant, or a usage error that says every way to give one."""
    if settings.tenant:
        return settings.tenant
    raise client.Failure(
        f"no tenant: pass --tenant, set ${TENANT_ENV}, or put 'tenant:' in the config file",
        exit_code=client.EXIT_USAGE,
    )
