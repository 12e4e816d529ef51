"""The database values: a URL (in the chart's Secret or in yours), or the host and its parts.

- The URL forms are as before: DATABASE_URL from the chart's Secret (``database.url``) or from
  yours (``database.existingSecret``).
- ``database.host`` (with port, name, user, passwordSecret): no URL and no Secret of the
  chart's. The operator gets ``DATABASE_URL=postgresql://`` and libpq's PGHOST, PGPORT,
  PGDATABASE, PGUSER, PGPASSWORD (from your Secret); PGSSLMODE comes with every form.
- The schema refuses a host beside a URL (naming both fields), the parts without a host, and a
  host without its database or role.
- The real thing: the rendered environment, resolved as the kubelet would, is what the real
  ``better-compute-operator`` command parses, and the operator's own ``open_database`` with it
  connects to a real PostgreSQL (migrations included), with the database, role, password and
  sslmode the values gave: libpq honours the variables behind an empty URL.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import helm_python
import psycopg
import pytest
import typer

from bettercompute.operator import running
from bettercompute.service import backing
from tests.chart import rendering
from tests.support.database import drop_database, fresh_database

PARTS = {
    "host": "db.example",
    "name": "bcd",
    "user": "bcd_operator",
    "passwordSecret": {"name": "bcd-db", "key": "password"},
}


def _env(rendered: rendering.Rendered) -> dict[str, Any]:
    (container,) = rendering.pod_spec(rendered.one("StatefulSet"))["containers"]
    return rendering.env_of(container)


def _database(**values: Any) -> dict[str, Any]:
    return {"database": values}


def test_by_default_the_url_is_read_from_the_release_secret(defaults: rendering.Rendered):
    env = _env(defaults)
    assert env["DATABASE_URL"] == {
        "secretKeyRef": {"name": "bc-better-compute-database", "key": "url"}
    }
    assert env["PGSSLMODE"] == "prefer"  # libpq's own default: an upgrade changes nothing
    assert not {"PGHOST", "PGPORT", "PGDATABASE", "PGUSER", "PGPASSWORD"} & set(env)


def test_a_url_is_kept_in_the_charts_secret(render: Callable):
    url = "postgresql://bcd:secret@db.example:5432/bcd?sslmode=verify-full"
    rendered = render(_database(url=url, sslmode="require"))
    secret = rendered.one("Secret", "bc-better-compute-database")
    assert secret["stringData"] == {"url": url}
    env = _env(rendered)
    assert env["DATABASE_URL"] == {
        "secretKeyRef": {"name": "bc-better-compute-database", "key": "url"}
    }
    # Set for every form; the URL's own sslmode wins in libpq.
    assert env["PGSSLMODE"] == "require"
    assert "PGHOST" not in env


def test_by_host_there_is_no_url_and_no_secret_of_the_charts(render: Callable):
    rendered = render(_database(**PARTS, port=6432, sslmode="verify-full"))
    env = _env(rendered)
    assert env["DATABASE_URL"] == "postgresql://"
    assert {k: v for k, v in env.items() if k.startswith("PG")} == {
        "PGHOST": "db.example",
        "PGPORT": "6432",
        "PGDATABASE": "bcd",
        "PGUSER": "bcd_operator",
        "PGPASSWORD": {"secretKeyRef": {"name": "bcd-db", "key": "password"}},
        "PGSSLMODE": "verify-full",
    }
    # No Secret of the chart's at all: not the database's, and the webhook certificate's is
    # the operator's to make.
    assert [s["metadata"]["name"] for s in rendered.of("Secret")] == []
    assert "create secret generic bcd-db --from-literal=password='PASSWORD'" in rendered.notes
    assert "bc-better-compute-database" not in rendered.notes


def test_by_host_without_a_password_secret_there_is_no_password(render: Callable):
    parts = {**PARTS, "passwordSecret": {"name": "", "key": "password"}}
    env = _env(render(_database(**parts)))
    assert env["PGPORT"] == "5432"
    assert "PGPASSWORD" not in env


# (values, the paths the message must name, a word of the reason)
REFUSED = [
    (
        _database(url="postgresql://db.example/bcd", **PARTS),
        ["/database/url", "/database/host"],
        "value must be ''",
    ),
    (
        _database(existingSecret={"name": "pg", "key": "dsn"}, **PARTS),
        ["/database/existingSecret/name", "/database/host"],
        "value must be ''",
    ),
    (_database(host="db.example", name="bcd"), ["/database/user"], "minLength"),
    (_database(host="db.example", user="bcd"), ["/database/name"], "minLength"),
    (_database(user="bcd"), ["/database/user"], "value must be ''"),
    (
        _database(passwordSecret={"name": "bcd-db", "key": "password"}),
        ["/database/passwordSecret/name"],
        "value must be ''",
    ),
    (_database(sslmode="on"), ["/database/sslmode"], "one of"),
    (_database(port=0), ["/database/port"], "minimum"),
    (_database(port="5432"), ["/database/port"], "want integer"),
    (
        _database(**{**PARTS, "passwordSecret": {"name": "Bad_Name", "key": "password"}}),
        ["/database/passwordSecret/name"],
        "pattern",
    ),
]


@pytest.mark.parametrize(("values", "paths", "reason"), REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_the_schema_refuses_a_mixed_or_partial_database(
    chart: helm_python.Chart, values: dict[str, Any], paths: list[str], reason: str
):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, values)
    message = str(refused.value)
    for path in paths:
        assert f"at '{path}'" in message, message
    assert reason in message, message


def test_the_operator_may_not_be_given_a_variable_the_chart_sets(render: Callable):
    with pytest.raises(helm_python.HelmError) as refused:
        render({"operator": {"extraEnv": [{"name": "PGSSLMODE", "value": "disable"}]}})
    assert 'operator.extraEnv[0]: name "PGSSLMODE" is the chart\'s own' in str(refused.value)


@pytest.fixture
def postgres(pg_server_dsn: str) -> Any:
    """A fresh database on the tests' PostgreSQL, and how the chart would be told about it."""
    name = "bettercompute_chart_parts"
    fresh_database(pg_server_dsn, name)
    server = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    try:
        yield {
            "host": str(server.get("host") or "localhost"),
            "port": int(server.get("port") or 5432),
            "name": name,
            "user": str(server.get("user") or os.environ.get("USER", "postgres")),
            "password": str(server.get("password") or "unused-by-trust"),
        }
    finally:
        drop_database(pg_server_dsn, name)


async def test_the_operator_connects_with_the_parts_alone(
    render: Callable, postgres: dict[str, Any], monkeypatch
):
    values = _database(
        host=postgres["host"],
        port=postgres["port"],
        name=postgres["name"],
        user=postgres["user"],
        passwordSecret={"name": "pg-login", "key": "password"},
        # Not libpq's default, and works whether or not the server offers TLS.
        sslmode="allow",
    )
    rendered = render(values)
    secrets = {("pg-login", "password"): postgres["password"]}
    for name in list(os.environ):
        if name.startswith("PG") or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    for name, value in _env(rendered).items():
        if isinstance(value, dict) and "secretKeyRef" in value:
            ref = value["secretKeyRef"]
            value = secrets[ref["name"], ref["key"]]
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    (container,) = rendering.pod_spec(rendered.one("StatefulSet"))["containers"]
    command = typer.main.get_command(running.cli)
    params = command.make_context(container["command"][0], []).params
    assert params["database_url"] == "postgresql://"
    # What running.started does with it: open (and migrate) through the operator's own code.
    db = await backing.open_database(
        params["database_url"], limits=backing.limits_from_environ(os.environ)
    )
    try:
        async with db.connection() as conn:
            info = conn.info
            assert (info.dbname, info.user) == (postgres["name"], postgres["user"])
            assert info.password == postgres["password"]  # PGPASSWORD, from the Secret
            options = {o.keyword: o.val for o in conn.pgconn.info}
            assert options[b"sslmode"] == b"allow"  # PGSSLMODE
            cur = await conn.execute("SELECT count(*) AS n FROM schema_migrations")
            assert (await cur.fetchone())["n"] > 0  # migrated at open, as at the operator's start
    finally:
        await db.close()


def test_internal_webhook_receivers_reach_the_operator_only_when_listed(
    defaults: rendering.Rendered, render: Callable
):
    assert "BCD_EVENT_WEBHOOK_ALLOW" not in _env(defaults)
    rendered = render({"operator": {"eventWebhookAllow": ["10.20.0.0/16", "hooks.internal"]}})
    assert _env(rendered)["BCD_EVENT_WEBHOOK_ALLOW"] == "10.20.0.0/16 hooks.internal"
