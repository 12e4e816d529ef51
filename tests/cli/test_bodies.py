"""The request bodies the CLI builds from its flags, and the settings it reads. No server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bettercompute.cli import bodies, client, settings
from bettercompute.cli.parsing import ParseError
from bettercompute.cli.settings import Output
from bettercompute.core import requests


def ask(**overrides: Any) -> bodies.Ask:
    values: dict[str, Any] = {"tenant": "acme", "pool": "pool_a", "duration": "8h"}
    values.update(overrides)
    return bodies.Ask(**values)


@pytest.mark.parametrize(
    ("flags", "devices"),
    [
        ({"gpus": 4}, [{"class": "gpu", "count": 4}]),
        ({"gpus": 4, "nvlink": True}, [{"class": "gpu", "count": 4, "topology": "nvlink-all"}]),
        ({"mig": "1g.10gb"}, [{"class": "mig", "profile": "1g.10gb", "count": 1}]),
        ({"mig": "3g.40gb", "count": 2}, [{"class": "mig", "profile": "3g.40gb", "count": 2}]),
        ({"slots": 8}, [{"class": "slot", "count": 8}]),
    ],
)
def test_devices(flags: dict[str, Any], devices: list[dict[str, Any]]):
    assert bodies.devices(ask(**flags)) == devices


@pytest.mark.parametrize(
    ("flags", "option", "says"),
    [
        ({}, "--gpus", "give exactly one of --gpus N, --mig PROFILE or --slots N"),
        ({"gpus": 1, "slots": 2}, "--slots", "(got --gpus and --slots)"),
        ({"gpus": 1, "count": 2}, "--count", "use it with --mig"),
        ({"slots": 2, "nvlink": True}, "--nvlink", "needs whole GPUs"),
    ],
)
def test_impossible_device_flags_name_the_flag(flags: dict[str, Any], option: str, says: str):
    with pytest.raises(ParseError) as info:
        bodies.devices(ask(**flags))
    assert info.value.option == option
    assert says in str(info.value)


def test_create_body_is_a_valid_create_input():
    body = bodies.create(
        ask(gpus=2, start_ms=1_790_000_000_000, gang=2, cpus=32, memory_gib=256, kubernetes=True),
        key="cli-1",
        wait_s=20,
        spot=True,
        lease_seconds=600,
        project="proj_1",
    )
    assert body == {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 2}],
        "duration": "8h",
        "start": 1_790_000_000_000,
        "gang": {"size": 2},
        "resources": {"vcpu": 32, "memoryGiB": 256},
        "binding": "kubernetes",
        "spot": True,
        "leaseSeconds": 600,
        "projectId": "proj_1",
        "idempotencyKey": "cli-1",
        "wait": {"timeoutMs": 20_000},
    }
    # The server's own model accepts it: the CLI sends nothing the API does not know.
    requests.parse(requests.CreateInput, body)


def test_a_plain_create_body_leaves_defaults_to_the_server():
    body = bodies.create(ask(gpus=1), key="k", wait_s=0)
    assert body == {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "8h",
        "idempotencyKey": "k",
    }
    assert bodies.request(ask(gpus=1, cpus=0))["resources"] == {"vcpu": 0}


def test_extend_body_takes_exactly_one_of_until_or_by():
    until = bodies.extend(tenant="acme", reservation_id="rsv_1", key="k", until_ms=5, by=None)
    assert until == {
        "tenantId": "acme",
        "reservationId": "rsv_1",
        "until": 5,
        "idempotencyKey": "k",
    }
    by = bodies.extend(tenant="acme", reservation_id="rsv_1", key="k", until_ms=None, by="4h")
    assert by["by"] == "4h"
    assert "until" not in by
    requests.parse(requests.ExtendInput, by)
    for until_ms, by_text in ((None, None), (5, "4h")):
        with pytest.raises(ParseError, match="exactly one of --until"):
            bodies.extend(
                tenant="acme", reservation_id="rsv_1", key="k", until_ms=until_ms, by=by_text
            )


# --- settings ------------------------------------------------------------------------------


def write_config(home: Path, text: str) -> Path:
    path = home / ".config" / "better-compute" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def resolve(env: dict[str, str], **flags: Any) -> settings.Settings:
    values: dict[str, Any] = {"url": None, "token": None, "tenant": None, "output": None}
    values.update(flags)
    return settings.resolve(environ=env, **values)


def test_defaults_without_flags_env_or_file(home: Path):
    found = resolve({})
    assert (found.url, found.token, found.tenant, found.output) == (
        "http://127.0.0.1:8080",
        None,
        None,
        Output.TABLE,
    )
    assert found.config_path is None


def test_flag_beats_env_beats_config_file(home: Path):
    path = write_config(home, "url: http://file:1\ntoken: file-token\ntenant: file-tenant\n")
    env = {"BETTER_COMPUTE_URL": "http://env:2", "BETTER_COMPUTE_TOKEN": "env-token"}

    from_all = resolve(env, url="http://flag:3")
    assert from_all.url == "http://flag:3"
    assert from_all.token == "env-token"
    assert from_all.tenant == "file-tenant"
    assert from_all.config_path == path


def test_a_named_config_file_must_exist(home: Path):
    missing = home / "nope.yaml"
    with pytest.raises(client.Failure) as info:
        resolve({"BETTER_COMPUTE_CONFIG": str(missing)})
    assert info.value.exit_code == client.EXIT_USAGE
    assert str(missing) in info.value.message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("url: [", "is not valid YAML"),
        ("- url\n", "must be a mapping with keys url, token, tenant"),
        ("server: http://x\n", "unknown key 'server' (known: url, token, tenant)"),
        ("token: 12\n", "token must be a non-empty string"),
    ],
)
def test_a_bad_config_file_is_a_usage_error_naming_it(home: Path, text: str, says: str):
    path = write_config(home, text)
    with pytest.raises(client.Failure) as info:
        resolve({})
    assert info.value.exit_code == client.EXIT_USAGE
    assert str(path) in info.value.message
    assert says in info.value.message


def test_an_empty_config_file_is_no_settings(home: Path):
    write_config(home, "")
    assert resolve({}).url == settings.DEFAULT_URL


def test_the_tenant_is_required_with_every_way_to_give_it(home: Path):
    with pytest.raises(client.Failure) as info:
        settings.require_tenant(resolve({}))
    assert info.value.exit_code == client.EXIT_USAGE
    assert "--tenant" in info.value.message
    assert "$BETTER_COMPUTE_TENANT" in info.value.message
    assert settings.require_tenant(resolve({"BETTER_COMPUTE_TENANT": "acme"})) == "acme"


@pytest.mark.parametrize("url", ["foo://x", "127.0.0.1:8080", "http://"])
def test_a_url_that_is_no_server_address_is_a_usage_error(url: str):
    with pytest.raises(client.Failure) as info:
        client.ApiClient(url=url, token=None)
    assert info.value.exit_code == client.EXIT_USAGE
    assert "--url" in info.value.message
