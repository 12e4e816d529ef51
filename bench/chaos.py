"""Chaos: keyed writers against a server that is killed at random points, then invariants.

Why: a reservation system earns trust by what survives a crash. This harness starts
``better-compute dev`` (embedded PostgreSQL, reconciler, simulated nodes, HTTP API) on a fresh
state dir, or the same stack on a given ``DATABASE_URL`` (``dev --database-url``), and runs
16-32 concurrent writers over HTTP: keyed creates, extends (the ``until`` form) and releases,
each retried on a 503 or a lost connection with the SAME idempotency key and body, as a careful
client would. Meanwhile it kills, at random points chosen by ``--seed``:

* ``server-sigkill``  the server process, SIGKILL; the harness restarts it on the same state;
* ``server-sigint``   the server process, Ctrl-C (SIGINT); it must exit 0 within
                      ``--shutdown-timeout`` and stop its PostgreSQL; then restarted;
* ``pg-sigkill``      the embedded PostgreSQL's postmaster (first line of
                      ``<state>/pg/postmaster.pid``), SIGKILL; the server must recover alone;
* ``pg-freeze``       every PostgreSQL process SIGSTOPped for up to ``--freeze-max`` s, then
                      SIGCONT; the server must ride it out.

After each recovery, and at the end, it checks from SQL and the API: no overlapping bookings,
the quota ledger equals the sum over live reservations, the budget never overrun, every
acknowledged create present with its id and key, one reservation per key, acknowledged releases
and extends kept, no retried extend refused as "in flight", nothing stuck after the reconciler's
first pass (overdue wake-ups, claims on finished requests, extend holds that still block, old
``binding``), no 500, every kill recovered within ``--recovery-timeout`` (else the harness
restarts the server itself, so the run stays bounded), and the server never died unless the
harness killed it. It prints the figures (kills by kind, operations sent, acknowledged, refused
and retried, 503s, 500s, recovery times, latencies, the server's ERROR log lines) and exits 1
when any invariant fails.

What it must never do: hang (every wait is bounded; a server that dies is a failed invariant,
then restarted so the run can finish), kill a process it did not start, or leave a server or
PostgreSQL of its own running when it ends.

    .venv/bin/python bench/chaos.py --kills 10 --seed 7
    .venv/bin/python bench/chaos.py --kills 5 --seed 1 --database-url postgresql://…/scratch
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import psycopg.rows
import yaml

SERVER_KINDS = ("server-sigkill", "server-sigint")
PG_KINDS = ("pg-sigkill", "pg-freeze")
KINDS = (*SERVER_KINDS, *PG_KINDS)
POOL = "pool_h100"
GPUS_PER_NODE = 8
MINUTE_MS = 60_000
#: States whose reservation holds its quota charge (a terminal state has refunded it).
LIVE = ("pending", "placed", "binding", "active", "releasing")
TERMINAL = ("released", "cancelled", "failed", "expired", "denied")


# --- the world the writers act in -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Writer:
    index: int
    tenant: str
    identity: str
    token: str


def writers_for(count: int) -> list[Writer]:
    """Two writers of three for the owner ``acme``, one for ``globex``, which books ``acme``'s
    pool through an offer that checks its budget."""
    out = []
    for w in range(count):
        tenant = "globex" if w % 3 == 2 else "acme"
        out.append(Writer(w, tenant, f"w{w:02d}@{tenant}", f"bcchaos_w{w:02d}_{tenant}"))
    return out


def dev_config(writers: Sequence[Writer], *, acme_quota: int, globex_quota: int, budget: float):
    """The dev configuration (docs/dev-config.md): one exclusive H100 pool owned by ``acme``,
    offered to ``globex`` with a budget; ``--sim`` fills it with nodes."""
    return {
        "tenants": [
            {"id": "root", "name": "Platform", "root": True},
            {"id": "acme", "name": "Acme"},
            {"id": "globex", "name": "Globex"},
        ],
        "identities": [{"id": w.identity, "tenant": w.tenant, "token": w.token} for w in writers],
        "pools": [
            {
                "id": POOL,
                "owner": "acme",
                "region": "eu-west-1",
                "model": "H100",
                "sharing": "exclusive",
            }
        ],
        # drain: creates and extends are both checked, so no admitted change can overrun it.
        "offers": [{"pool": POOL, "tenant": "globex", "onBudgetExceeded": "drain"}],
        "quotas": [
            {"tenant": "acme", "resource": "gpu:H100", "limit": acme_quota},
            {"tenant": "globex", "resource": "gpu:H100", "limit": globex_quota},
        ],
        "budgets": [{"tenant": "globex", "gpuHours": budget, "windowSeconds": 2_592_000}],
        "defaultPolicies": True,
    }


# --- what happened ----------------------------------------------------------------------------


@dataclasses.dataclass
class Kill:
    number: int
    kind: str
    at_s: float
    recovered_s: float | None = None
    note: str = ""


@dataclasses.dataclass
class Figures:
    sent: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    acked: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refused: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    gave_up: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    attempts: int = 0
    retried: int = 0
    status_503: int = 0
    status_500: int = 0
    transport_errors: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )
    samples_500: list[str] = dataclasses.field(default_factory=list)
    #: (finished at, seconds) of every answered attempt, for the soak's per-minute figures.
    latencies: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    #: create key -> every reservation id a 200 answered for it
    create_ids: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    #: reservation id -> (writer, key)
    created: dict[str, tuple[Writer, str]] = dataclasses.field(default_factory=dict)
    released: set[str] = dataclasses.field(default_factory=set)
    #: reservation id -> the latest ``until`` an extend was acknowledged as extended to
    extended: dict[str, int] = dataclasses.field(default_factory=dict)
    create_conflicts: list[str] = dataclasses.field(default_factory=list)
    #: operation -> the longest time from its first attempt to its answer, s
    longest: dict[str, float] = dataclasses.field(default_factory=dict)


class Answer:
    """One logical operation's end: ``data`` on a 200, else the refusal's code or None."""

    def __init__(self, data: dict[str, Any] | None = None, code: str | None = None):
        self.data = data
        self.code = code


class Client:
    """One writer's HTTP client: every operation retried with the same body on a 503
    (``UNAVAILABLE``), a 500 or a lost connection, until answered or ``op_timeout`` passes."""

    def __init__(
        self,
        url: str,
        writer: Writer,
        figures: Figures,
        *,
        op_timeout: float,
        request_timeout: float,
    ):
        self.writer = writer
        self.figures = figures
        self.op_timeout = op_timeout
        self.http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {writer.token}", "X-Better-Compute": "1"},
            timeout=httpx.Timeout(request_timeout, connect=2.0),
            limits=httpx.Limits(max_connections=2),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def call(self, op: str, body: dict[str, Any], *, count: bool = True) -> Answer:
        f = self.figures
        if count:
            f.sent[op] += 1
        began = time.monotonic()
        deadline = began + self.op_timeout
        delay = 0.1
        first = True
        while True:
            if not first:
                f.retried += 1
            first = False
            f.attempts += 1
            retry_after = 0.0
            t0 = time.perf_counter()
            try:
                response = await self.http.post(f"/api/compute/reservations/{op}", json=body)
            except httpx.TransportError as e:
                f.transport_errors[type(e).__name__] += 1
            else:
                f.latencies.append((time.monotonic(), time.perf_counter() - t0))
                code = _error_code(response)
                if response.status_code == 200:
                    if count:
                        f.acked[op] += 1
                        took = time.monotonic() - began
                        f.longest[op] = max(took, f.longest.get(op, 0.0))
                    return Answer(data=response.json()["data"])
                if response.status_code >= 500 and code != "CAPACITY_UNAVAILABLE":
                    if response.status_code == 500:
                        f.status_500 += 1
                        if len(f.samples_500) < 5:
                            f.samples_500.append(f"{op}: {response.text[:300]}")
                    elif response.status_code == 503:
                        f.status_503 += 1
                        retry_after = _seconds(response.headers.get("Retry-After"))
                else:
                    reason = _error_reason(response)
                    if count:
                        f.refused[f"{op} {response.status_code} {code}{reason}"] += 1
                    return Answer(code=code or str(response.status_code))
            if time.monotonic() >= deadline:
                if count:
                    f.gave_up[op] += 1
                return Answer()
            pause = min(max(delay, retry_after), 2.0) * random.uniform(0.5, 1.0)
            await asyncio.sleep(pause)
            delay = min(delay * 2, 1.0)


def _error_code(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(response.json()["error"]["code"])
    return ""


def _error_reason(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        reason = response.json()["error"]["details"].get("reason")
        if reason:
            return f"/{reason}"
    return ""


def _seconds(value: str | None) -> float:
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0


async def write(
    client: Client, rng: random.Random, stop: asyncio.Event, run: str, *, think: float = 0.05
) -> None:
    """One writer: create (keyed, fixed body), sometimes extend to a fixed ``until``, then
    release now or later (it keeps at most one reservation unreleased at a time); then a
    pause of up to ``think`` s."""
    w = client.writer
    f = client.figures
    kept: collections.deque[str] = collections.deque()
    n = 0
    while not stop.is_set():
        n += 1
        key = f"chaos-{run}-w{w.index:02d}-{n}"
        body: dict[str, Any] = {
            "tenantId": w.tenant,
            "poolId": POOL,
            "devices": [{"class": "gpu", "count": rng.choice((1, 1, 2))}],
            "duration": rng.choice(("30m", "1h", "2h")),
            "idempotencyKey": key,
        }
        if rng.random() < 0.3:
            # A future window: placed, not bound; its extends move a booking not yet started.
            body["start"] = int(time.time() * 1000) + rng.randint(1, 6) * 60 * MINUTE_MS
        answer = await client.call("create", body)
        if answer.data is None:
            if answer.code == "CONFLICT":
                f.create_conflicts.append(key)
            await asyncio.sleep(rng.uniform(0.05, 0.2))
            continue
        rid = str(answer.data["id"])
        f.create_ids.setdefault(key, set()).add(rid)
        f.created[rid] = (w, key)
        during = answer.data.get("during")
        if (
            answer.data["state"] in ("placed", "binding", "active")
            and during
            and rng.random() < 0.5
        ):
            until = int(during["end"]) + rng.choice((15, 30, 60)) * MINUTE_MS
            extend = await client.call(
                "extend",
                {
                    "tenantId": w.tenant,
                    "reservationId": rid,
                    "until": until,
                    "idempotencyKey": f"{key}-x",
                },
            )
            if extend.data is not None and extend.data.get("extended"):
                f.extended[rid] = max(until, f.extended.get(rid, 0))
        to_release = []
        if rng.random() < 0.7:
            to_release.append(rid)
        else:
            kept.append(rid)
            if len(kept) > 1:
                to_release.append(kept.popleft())
        for each in to_release:
            released = await client.call("release", {"tenantId": w.tenant, "reservationId": each})
            if released.data is not None:
                f.released.add(each)
        await asyncio.sleep(rng.uniform(0, think))


# --- the server under test --------------------------------------------------------------------


class Server:
    """``better-compute dev`` (on its embedded PostgreSQL or a given ``DATABASE_URL``) as a
    child process of ours, restartable on the same state dir and port."""

    def __init__(self, *, state: Path, config: Path, port: int, sim: int, database_url: str | None):
        self.state = state
        self.config = config
        self.port = port
        self.sim = sim
        self.database_url = database_url
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0
        #: True while the harness itself is stopping or killing it.
        self.expected_exit = False
        self.log: Path | None = None

    def command(self) -> list[str]:
        common = ["--config", str(self.config), "--sim", str(self.sim), "--port", str(self.port)]
        common += ["--metrics-port", "0"]
        if self.database_url:
            common += ["--database-url", self.database_url]
        script = Path(sys.executable).with_name("better-compute")
        head = (
            [str(script)]
            if script.exists()
            else [sys.executable, "-c", "from bettercompute.cli.app import main; main()"]
        )
        return [*head, "dev", "--state-dir", str(self.state), *common]

    def start(self) -> None:
        self.generation += 1
        self.log = self.state.parent / f"server-{self.generation}.log"
        with self.log.open("wb") as out:
            # Its own session: a Ctrl-C at the harness's terminal is the harness's to handle.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "COLUMNS": "200"},
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def stop(self, sig: int, within: float) -> tuple[int | None, float]:
        """Send ``sig`` and wait up to ``within`` s; (exit code or None, seconds taken)."""
        assert self.proc is not None
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        while time.monotonic() - t0 < within:
            if self.proc.poll() is not None:
                return self.proc.returncode, time.monotonic() - t0
            await asyncio.sleep(0.05)
        return None, time.monotonic() - t0

    async def ready(self, within: float) -> bool:
        """``/readyz`` answers 200 within ``within`` s (False at once if the process ended)."""
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    return False
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.url}/readyz")).status_code == 200:
                        return True
                await asyncio.sleep(0.1)
        return False

    def tail(self, lines: int = 12) -> str:
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(f"    | {line}" for line in text[-lines:])

    # PostgreSQL of the dev stack (none of ours with a DATABASE_URL)

    @property
    def pg_dir(self) -> Path:
        return self.state / "pg"

    def postmaster(self) -> psutil.Process | None:
        try:
            pid = int((self.pg_dir / "postmaster.pid").read_text().splitlines()[0])
            process = psutil.Process(pid)
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return process if process.is_running() else None

    def dsn(self) -> str:
        if self.database_url:
            return self.database_url
        lines = (self.pg_dir / "postmaster.pid").read_text().splitlines()
        return psycopg.conninfo.make_conninfo(
            host=lines[4].strip(), port=lines[3].strip(), user="postgres", dbname="postgres"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_tree(postmaster: psutil.Process) -> list[psutil.Process]:
    try:
        return [postmaster, *postmaster.children(recursive=True)]
    except psutil.Error:
        return [postmaster]


def signal_all(processes: Sequence[psutil.Process], sig: int) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


# --- the invariants ---------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


async def sql_checks(dsn: str, figures: Figures, *, final: bool) -> list[Check]:
    """The ledger invariants, all read in one REPEATABLE READ snapshot (so a check during load
    compares numbers of one instant). ``final`` adds the stuck-work checks."""
    created = dict(figures.created)  # acknowledged before the snapshot begins
    released = set(figures.released)
    extended = dict(figures.extended)
    checks: list[Check] = []
    async with await psycopg.AsyncConnection.connect(
        dsn,
        autocommit=False,
        connect_timeout=5,
        row_factory=psycopg.rows.dict_row,
        options="-c statement_timeout=20000",
    ) as conn:
        # One transaction (autocommit off), one snapshot for every check below.
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await conn.set_read_only(True)

        async def rows(sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
            return await (await conn.execute(sql, params)).fetchall()

        overlap = await rows(
            "SELECT a.atom_id, a.reservation_id AS r1, b.reservation_id AS r2"
            "  FROM bookings a JOIN bookings b ON a.atom_id = b.atom_id AND a.id < b.id"
            "   AND a.during && b.during LIMIT 5"
        )
        total = (await rows("SELECT count(*) AS n FROM bookings"))[0]["n"]
        checks.append(
            Check(
                "no overlapping bookings",
                not overlap,
                f"{total} bookings" if not overlap else f"overlaps: {overlap}",
            )
        )

        quota = await rows(
            "SELECT q.tenant_id, q.resource, q.used, coalesce(s.charged, 0) AS charged"
            "  FROM quotas q LEFT JOIN ("
            "    SELECT r.tenant_id, c.key AS resource, sum(c.value::bigint) AS charged"
            "      FROM reservations r, jsonb_each_text(r.quota_charge) c"
            "     WHERE r.state = ANY(%s) GROUP BY 1, 2"
            "  ) s ON s.tenant_id = q.tenant_id AND s.resource = q.resource"
            " ORDER BY 1, 2",
            (list(LIVE),),
        )
        wrong = [q for q in quota if q["used"] != q["charged"]]
        checks.append(
            Check(
                "quota ledger = sum over live reservations",
                not wrong,
                "; ".join(
                    f"{q['tenant_id']} {q['resource']} used {q['used']} charged {q['charged']}"
                    for q in (wrong or quota)
                ),
            )
        )

        # The spend as the budget check computes it (store/budgets.py, bc_budget_state): hours
        # used in the window plus hours still booked. Under drain every create and extend is
        # checked against it under the tenant's budget lock, so it never passes the budget.
        budgets = await rows(
            "SELECT b.tenant_id, b.gpu_hours AS budget, s.spent"
            "  FROM budgets b, LATERAL bc_budget_state(b.tenant_id) s ORDER BY 1"
        )
        unprojected = (
            await rows(
                "SELECT count(*) AS n FROM reservations r WHERE r.state NOT IN"
                " ('draft', 'denied', 'awaiting-confirmation') AND NOT EXISTS"
                " (SELECT 1 FROM authz_resources a WHERE a.id = r.id)"
            )
        )[0]["n"]
        over = [b for b in budgets if float(b["spent"]) > float(b["budget"]) + 1e-6]
        checks.append(
            Check(
                "budget spend within the budget, every admitted reservation counted",
                not over and not unprojected,
                "; ".join(
                    f"{b['tenant_id']} spent {float(b['spent']):.2f} of "
                    f"{float(b['budget']):g} GPU-h"
                    for b in budgets
                )
                + (f"; {unprojected} admitted without an authz row" if unprojected else ""),
            )
        )

        ids = list(created)
        found = {
            r["id"]: r
            for r in await rows(
                "SELECT id, tenant_id, owner_identity_id, idempotency_key, state,"
                " epoch_ms(upper(during)) AS end_ms FROM reservations WHERE id = ANY(%s)",
                (ids,),
            )
        }
        lost = [rid for rid in ids if rid not in found]
        mismatched = [
            rid
            for rid, (w, key) in created.items()
            if rid in found
            and (
                found[rid]["idempotency_key"] != key
                or found[rid]["tenant_id"] != w.tenant
                or found[rid]["owner_identity_id"] != w.identity
            )
        ]
        checks.append(
            Check(
                "every acknowledged create present, same id and key",
                not lost and not mismatched,
                f"{len(ids)} acknowledged"
                + (f"; missing {lost[:5]}" if lost else "")
                + (f"; other key or owner {mismatched[:5]}" if mismatched else ""),
            )
        )

        many = [k for k, v in figures.create_ids.items() if len(v) > 1]
        dupes = await rows(
            "SELECT tenant_id, owner_identity_id, idempotency_key, count(*) AS n"
            "  FROM reservations GROUP BY 1, 2, 3 HAVING count(*) > 1 LIMIT 5"
        )
        conflicts = list(figures.create_conflicts)
        checks.append(
            Check(
                "same-key retries give the same id (one reservation per key)",
                not many and not dupes and not conflicts,
                f"{len(figures.create_ids)} keys"
                + (f"; keys answered with several ids {many[:5]}" if many else "")
                + (f"; duplicated in SQL {dupes}" if dupes else "")
                + (f"; same key and body refused CONFLICT {conflicts[:5]}" if conflicts else ""),
            )
        )

        unreleased = [
            rid for rid in released if rid in found and found[rid]["state"] not in TERMINAL
        ]
        shrunk = [
            (rid, found[rid]["end_ms"], until)
            for rid, until in extended.items()
            if rid in found
            and rid not in released
            and found[rid]["state"] in ("placed", "binding", "active")
            and (found[rid]["end_ms"] or 0) < until
        ]
        checks.append(
            Check(
                "acknowledged releases and extends kept",
                not unreleased and not shrunk,
                f"{len(released)} released, {len(extended)} extended"
                + (f"; live again {unreleased[:5]}" if unreleased else "")
                + (f"; end before the acknowledged until {shrunk[:5]}" if shrunk else ""),
            )
        )

        if final:
            checks.extend(await stuck_checks(rows))
    return checks


async def stuck_checks(rows: Any) -> list[Check]:
    checks = []
    overdue = await rows(
        "SELECT count(*) AS n, extract(epoch FROM compute_now() - min(due_at)) AS late"
        "  FROM work_queue WHERE due_at < compute_now() - interval '10 seconds'"
    )
    late = overdue[0]
    placed_late = await rows(
        "SELECT id FROM reservations WHERE state = 'placed'"
        "   AND lower(during) < compute_now() - interval '15 seconds' LIMIT 5"
    )
    checks.append(
        Check(
            "no wake-up overdue (> 10 s), no placed reservation past its start (> 15 s)",
            late["n"] == 0 and not placed_late,
            f"{late['n']} overdue"
            + (f" (the oldest {float(late['late']):.0f} s late)" if late["n"] else "")
            + (f"; placed past start {[r['id'] for r in placed_late]}" if placed_late else ""),
        )
    )
    claims = await rows(
        "SELECT i.id, i.scope, r.state FROM idempotency i"
        "  LEFT JOIN reservations r ON r.id = i.reservation_id"
        " WHERE i.claim IS NOT NULL AND (i.outcome IS NOT NULL"
        "   OR r.state NOT IN ('draft', 'awaiting-confirmation')) LIMIT 5"
    )
    drafts = (
        await rows(
            "SELECT count(*) AS n FROM idempotency i JOIN reservations r ON r.id = i.reservation_id"
            " WHERE i.claim IS NOT NULL AND r.state = 'draft'"
        )
    )[0]["n"]
    checks.append(
        Check(
            "no idempotency claim left on a finished request",
            not claims,
            (f"{claims}" if claims else "none") + f"; {drafts} abandoned drafts still claimed",
        )
    )
    binding = await rows(
        "SELECT id, extract(epoch FROM compute_now() - updated_at) AS age FROM reservations"
        " WHERE state = 'binding' AND updated_at < compute_now() - interval '20 seconds' LIMIT 5"
    )
    checks.append(
        Check(
            "no reservation left binding (> 20 s) with live simulated nodes",
            not binding,
            f"{[(b['id'], round(float(b['age']))) for b in binding]}" if binding else "none",
        )
    )
    return checks


async def hold_probe(dsn: str, clients: dict[int, Client], figures: Figures) -> Check:
    """An extend hold left at the end (no extend is in flight any more) must not block the next
    extend: probe each such reservation with one extend of one more minute."""
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=5, row_factory=psycopg.rows.dict_row
    ) as conn:
        holds = await (
            await conn.execute(
                "SELECT h.reservation_id, epoch_ms(upper(r.during)) AS end_ms,"
                " extract(epoch FROM compute_now() - h.taken_at) AS age"
                "  FROM extend_holds h JOIN reservations r ON r.id = h.reservation_id"
                " WHERE r.state IN ('placed', 'binding', 'active')"
            )
        ).fetchall()
    blocked = []
    for hold in holds:
        rid = hold["reservation_id"]
        if rid not in figures.created:
            continue
        writer, key = figures.created[rid]
        answer = await clients[writer.index].call(
            "extend",
            {
                "tenantId": writer.tenant,
                "reservationId": rid,
                "until": int(hold["end_ms"]) + MINUTE_MS,
                "idempotencyKey": f"{key}-probe",
            },
            count=False,
        )
        if answer.data is None:
            blocked.append((rid, answer.code, round(float(hold["age"]))))
    return Check(
        "no extend hold left blocking an extend",
        not blocked,
        f"{len(holds)} holds left"
        + (f"; blocking (id, answer, age s): {blocked[:5]}" if blocked else ""),
    )


async def api_check(clients: dict[int, Client], figures: Figures) -> Check:
    """Every acknowledged create reads back through the API with the same id."""
    wrong: list[str] = []
    sem = asyncio.Semaphore(8)

    async def read(rid: str, writer: Writer) -> None:
        async with sem:
            answer = await clients[writer.index].call(
                "get", {"tenantId": writer.tenant, "reservationId": rid}, count=False
            )
            if answer.data is None or answer.data.get("id") != rid:
                wrong.append(f"{rid}: {answer.code or 'no answer'}")

    await asyncio.gather(*(read(rid, w) for rid, (w, _) in list(figures.created.items())))
    return Check(
        "every acknowledged create reads back through the API",
        not wrong,
        f"{len(figures.created)} read" + (f"; wrong {wrong[:5]}" if wrong else ""),
    )


# --- the run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    kills: int
    seed: int
    writers: int
    database_url: str | None
    kinds: tuple[str, ...]
    sim: int
    warmup: float
    min_gap: float
    max_gap: float
    freeze_max: float
    tail: float
    settle: float
    recovery_timeout: float
    shutdown_timeout: float
    op_timeout: float
    request_timeout: float
    check_each: bool
    state_dir: Path | None
    keep: bool
    json_path: Path | None
    budget: float


class Chaos:
    def __init__(self, opts: Options):
        self.opts = opts
        self.figures = Figures()
        self.kills: list[Kill] = []
        self.deaths: list[str] = []
        self.failures: list[str] = []
        self.checks_each: list[tuple[int, list[Check]]] = []
        self.t0 = time.monotonic()
        self.lock = asyncio.Lock()
        self.server: Server

    def since(self) -> float:
        return time.monotonic() - self.t0

    # the server's life

    async def watch(self, stop: asyncio.Event) -> None:
        """A server that ends while the harness did not stop it is a failed invariant; restart
        it so the run goes on and the other invariants can still be read."""
        server = self.server
        while not stop.is_set():
            await asyncio.sleep(0.1)
            async with self.lock:
                if server.expected_exit or server.alive() or server.proc is None:
                    continue
                code = server.proc.returncode
                self.deaths.append(
                    f"server process died (exit {code}) at {self.since():.1f} s, after "
                    f"{self.kills[-1].kind if self.kills else 'no kill'}; its last lines:\n"
                    f"{server.tail()}"
                )
                if self.kills:
                    self.kills[-1].note += f" server died (exit {code}), restarted by harness;"
                print(f"  ! server died (exit {code}); restarting it", flush=True)
                server.start()

    async def kill(self, number: int, kind: str, rng: random.Random) -> None:
        server = self.server
        record = Kill(number, kind, round(self.since(), 1))
        self.kills.append(record)
        t0 = time.monotonic()
        async with self.lock:
            if kind in SERVER_KINDS:
                postmaster = server.postmaster()
                server.expected_exit = True
                try:
                    if kind == "server-sigkill":
                        await server.stop(signal.SIGKILL, 10)
                    else:
                        await self.interrupt(number, record, postmaster)
                    server.start()
                finally:
                    server.expected_exit = False
            elif kind == "pg-sigkill":
                postmaster = server.postmaster()
                if postmaster is None:
                    record.note += " no PostgreSQL running to kill;"
                else:
                    postmaster.send_signal(signal.SIGKILL)
            else:
                postmaster = server.postmaster()
                if postmaster is None:
                    record.note += " no PostgreSQL running to freeze;"
                else:
                    frozen = pg_tree(postmaster)
                    pause = rng.uniform(self.opts.freeze_max / 3, self.opts.freeze_max)
                    signal_all(frozen, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(pause)
                    finally:
                        signal_all(frozen, signal.SIGCONT)
                    record.note += f" frozen {pause:.1f} s;"
        # A server kill is given the whole timeout from its restart, so a slow Ctrl-C (already
        # a failure of its own) does not count twice.
        recovered = await self.recovered(kind, since=t0, counted_from=time.monotonic())
        if recovered is None:
            self.failures.append(
                f"kill {number} ({kind}): not recovered within {self.opts.recovery_timeout:g} s"
            )
            record.note += " NOT RECOVERED, server restarted by the harness;"
            await self.restart()
        record.recovered_s = recovered
        print(
            f"  kill {number:>2} at {record.at_s:>6.1f} s  {kind:<15} recovered in "
            f"{'-' if recovered is None else f'{recovered:.1f} s'}{record.note}",
            flush=True,
        )

    async def interrupt(self, number: int, record: Kill, postmaster: psutil.Process | None) -> None:
        """Ctrl-C: the server must exit 0 within the shutdown timeout and stop its PostgreSQL."""
        server = self.server
        code, took = await server.stop(signal.SIGINT, self.opts.shutdown_timeout)
        record.note += f" Ctrl-C exit {code} in {took:.1f} s;"
        if code is None:
            self.failures.append(
                f"kill {number}: Ctrl-C did not stop the server within "
                f"{self.opts.shutdown_timeout:g} s (SIGKILL sent)"
            )
            await server.stop(signal.SIGKILL, 10)
            return  # after our SIGKILL, a PostgreSQL left running is no fault of its own
        if code != 0:
            self.failures.append(f"kill {number}: Ctrl-C exit code {code}")
        if (
            postmaster is not None
            and not self.opts.database_url
            and await _still_running(postmaster, within_s=2)
        ):
            self.failures.append(
                f"kill {number}: Ctrl-C left PostgreSQL (pid {postmaster.pid}) running"
            )
            record.note += " PostgreSQL left running;"

    async def restart(self) -> None:
        """SIGKILL and start again a server that did not recover, so the run stays bounded."""
        async with self.lock:
            self.server.expected_exit = True
            try:
                if self.server.alive():
                    await self.server.stop(signal.SIGKILL, 10)
                self.server.start()
            finally:
                self.server.expected_exit = False
        await self.server.ready(60)

    async def recovered(self, kind: str, *, since: float, counted_from: float) -> float | None:
        """Seconds from the kill (``since``) until ready again (for a PostgreSQL kill: a new
        postmaster runs and the server answers /readyz 200), or None when the recovery
        timeout, counted from ``counted_from``, passes first."""
        deadline = counted_from + self.opts.recovery_timeout
        while time.monotonic() < deadline:
            if kind == "pg-sigkill" and self.server.postmaster() is None:
                await asyncio.sleep(0.1)
                continue
            if await self.server.ready(max(0.1, min(1.0, deadline - time.monotonic()))):
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return None

    async def run(self) -> int:
        o = self.opts
        own_state = o.state_dir is None
        root = Path(tempfile.mkdtemp(prefix="bc-chaos-")) if own_state else o.state_dir
        assert root is not None
        root.mkdir(parents=True, exist_ok=True)
        state = root / "state"
        writers = writers_for(o.writers)
        config = root / "chaos.yaml"
        capacity = o.sim * GPUS_PER_NODE
        config.write_text(
            yaml.safe_dump(
                dev_config(
                    writers,
                    acme_quota=capacity * 5 // 8,
                    globex_quota=capacity // 4,
                    budget=o.budget,
                ),
                sort_keys=False,
            )
        )
        self.server = Server(
            state=state, config=config, port=free_port(), sim=o.sim, database_url=o.database_url
        )
        where = f"DATABASE_URL service, state {root}" if o.database_url else f"dev on {root}"
        print(
            f"chaos: seed {o.seed}, {o.writers} writers, {o.kills} kills of "
            f"{', '.join(o.kinds)}; {where}; {o.sim} simulated nodes x {GPUS_PER_NODE} H100",
            flush=True,
        )
        clients: dict[int, Client] = {}
        stop_watch = asyncio.Event()
        watcher: asyncio.Task[None] | None = None
        try:
            self.server.start()
            if not await self.server.ready(60):
                self.failures.append(
                    f"the server did not start within 60 s:\n{self.server.tail(30)}"
                )
                return self.report([])
            print(f"  ready at {self.server.url} in {self.since():.1f} s", flush=True)
            watcher = asyncio.create_task(self.watch(stop_watch))
            clients = {
                w.index: Client(
                    self.server.url,
                    w,
                    self.figures,
                    op_timeout=o.op_timeout,
                    request_timeout=o.request_timeout,
                )
                for w in writers
            }
            run = f"{o.seed}-{os.getpid()}-{int(time.time())}"
            stop_writers = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    write(clients[w.index], random.Random(f"{o.seed}/{w.index}"), stop_writers, run)
                )
                for w in writers
            ]
            rng = random.Random(o.seed)
            await asyncio.sleep(o.warmup)
            for number, kind in enumerate(schedule(rng, o.kinds, o.kills), start=1):
                await asyncio.sleep(rng.uniform(o.min_gap, o.max_gap))
                await self.kill(number, kind, rng)
                if o.check_each:
                    with contextlib.suppress(psycopg.Error, OSError):
                        checks = await sql_checks(self.server.dsn(), self.figures, final=False)
                        self.checks_each.append((number, checks))
            await asyncio.sleep(o.tail)
            stop_writers.set()
            done, pending = await asyncio.wait(tasks, timeout=o.op_timeout * 3 + 10)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    self.failures.append(f"a writer crashed: {task.exception()!r}")
            if pending:
                self.failures.append(f"{len(pending)} writers did not finish their operation")
            final = await self.final_checks(clients)
            return self.report(final)
        finally:
            stop_watch.set()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            for client in clients.values():
                await client.close()
            await self.shutdown()
            if own_state and not o.keep:
                shutil.rmtree(root, ignore_errors=True)
            elif o.keep or not own_state:
                print(f"state and server logs kept in {root}")

    async def final_checks(self, clients: dict[int, Client]) -> list[Check]:
        """After the load stops: wait for the server, give the reconciler ``--settle`` seconds,
        then read every invariant (retrying the stuck-work ones until they pass or time runs
        out)."""
        if not await self.server.ready(self.opts.recovery_timeout):
            self.failures.append("the server was not ready for the final checks")
            return []
        deadline = time.monotonic() + self.opts.settle
        while True:
            try:
                checks = await sql_checks(self.server.dsn(), self.figures, final=True)
            except (psycopg.Error, OSError) as e:
                checks = [Check("the database is readable for the checks", False, str(e))]
            if all(c.ok for c in checks) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        checks.append(await api_check(clients, self.figures))
        with contextlib.suppress(psycopg.Error, OSError):
            checks.append(await hold_probe(self.server.dsn(), clients, self.figures))
        return checks

    async def shutdown(self) -> None:
        """Stop the server, then any PostgreSQL of ours it left running (after a SIGKILL, or a
        server that forgets to stop it: the checks already reported that)."""
        server = self.server
        postmaster = None if self.opts.database_url else server.postmaster()
        if server.alive():
            server.expected_exit = True
            code, _ = await server.stop(signal.SIGINT, self.opts.shutdown_timeout)
            if code is None:
                await server.stop(signal.SIGKILL, 10)
        postmaster = postmaster or (None if self.opts.database_url else server.postmaster())
        if postmaster is not None and postmaster.is_running():
            signal_all(pg_tree(postmaster), signal.SIGCONT)
            postmaster.send_signal(signal.SIGINT)  # fast shutdown
            with contextlib.suppress(psutil.TimeoutExpired):
                postmaster.wait(15)
            if postmaster.is_running():
                postmaster.kill()

    def server_log_errors(self) -> collections.Counter[str]:
        """ERROR lines of every server generation's log, without their time stamp and ids."""
        found: collections.Counter[str] = collections.Counter()
        for log in sorted(self.server.state.parent.glob("server-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if " ERROR " in line:
                    words = line.split(" ERROR ", 1)[1]
                    found[re.sub(r"req_[0-9a-z]+", "req_…", words)[:160]] += 1
        return found

    def report(self, final: list[Check]) -> int:
        f = self.figures
        o = self.opts
        print()
        by_kind = collections.Counter(k.kind for k in self.kills)
        print("kills:      " + ", ".join(f"{k} {by_kind.get(k, 0)}" for k in o.kinds))
        print(f"{'operation':<10} {'sent':>6} {'acked':>6} {'refused':>8} {'gave up':>8}")
        for op in ("create", "extend", "release"):
            refused = sum(n for k, n in f.refused.items() if k.startswith(op + " "))
            print(f"{op:<10} {f.sent[op]:>6} {f.acked[op]:>6} {refused:>8} {f.gave_up[op]:>8}")
        print(
            f"attempts:   {f.attempts}, retried {f.retried}, 503s {f.status_503}, "
            f"500s {f.status_500}, transport errors "
            f"{sum(f.transport_errors.values())} {dict(f.transport_errors) or ''}"
        )
        if f.refused:
            print("refusals:   " + ", ".join(f"{k}: {n}" for k, n in sorted(f.refused.items())))
        times = [k.recovered_s for k in self.kills if k.recovered_s is not None]
        if times:
            print(
                f"recovery:   max {max(times):.1f} s, p50 {statistics.median(times):.1f} s "
                f"over {len(times)} recovered kills"
            )
        if f.latencies:
            lat = sorted(s for _, s in f.latencies)
            print(
                f"latency:    p50 {pct(lat, 50) * 1000:.0f} ms, p99 {pct(lat, 99) * 1000:.0f} "
                f"ms, max {lat[-1] * 1000:.0f} ms per answered attempt"
            )
        if f.longest:
            print(
                "longest:    "
                + ", ".join(f"{op} {s:.1f} s" for op, s in sorted(f.longest.items()))
                + " from first attempt to answer (retries included)"
            )
        errors = self.server_log_errors()
        print(
            f"server log: {sum(errors.values())} ERROR lines"
            + "".join(f"\n    {n} x {line}" for line, n in errors.most_common(5))
        )
        checks = list(final)
        in_flight = sum(n for k, n in f.refused.items() if k.endswith("/extend-in-flight"))
        checks.append(
            Check(
                "no extend refused as in flight (each writer extends one at a time, so only a"
                " hold left by a lost attempt can refuse it)",
                in_flight == 0,
                f"{in_flight} refused",
            )
        )
        checks.append(
            Check(
                "no 500 answers",
                f.status_500 == 0,
                f"{f.status_500}" + (f": {f.samples_500}" if f.samples_500 else ""),
            )
        )
        checks.append(
            Check(
                "the server never died unless the harness killed it",
                not self.deaths,
                "\n".join(self.deaths) or "none",
            )
        )
        checks.append(
            Check(
                "every kill recovered; shutdowns clean",
                not self.failures,
                "; ".join(self.failures) or f"{len(self.kills)} kills",
            )
        )
        mid = [(n, c) for n, cs in self.checks_each for c in cs if not c.ok]
        if self.checks_each:
            checks.append(
                Check(
                    "ledger invariants after each kill",
                    not mid,
                    "; ".join(f"after kill {n}: {c.name}: {c.detail}" for n, c in mid[:5])
                    or f"checked after {len(self.checks_each)} kills",
                )
            )
        print("invariants:")
        for c in checks:
            print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
        ok = all(c.ok for c in checks) and bool(final)
        print(f"result: {'PASS' if ok else 'FAIL'} in {self.since():.1f} s")
        if o.json_path is not None:
            o.json_path.write_text(
                json.dumps(
                    {
                        "ok": ok,
                        "seed": o.seed,
                        "kills": [dataclasses.asdict(k) for k in self.kills],
                        "sent": dict(f.sent),
                        "acked": dict(f.acked),
                        "refused": dict(f.refused),
                        "gaveUp": dict(f.gave_up),
                        "attempts": f.attempts,
                        "retried": f.retried,
                        "status503": f.status_503,
                        "status500": f.status_500,
                        "failed": [c.name for c in checks if not c.ok],
                        "checks": [dataclasses.asdict(c) for c in checks],
                    },
                    indent=2,
                )
            )
        return 0 if ok else 1


def schedule(rng: random.Random, kinds: Sequence[str], kills: int) -> Iterator[str]:
    """Kinds in shuffled rounds: any ``len(kinds)`` kills in a row cover every kind once."""
    n = 0
    while n < kills:
        round_ = list(kinds)
        rng.shuffle(round_)
        for kind in round_[: kills - n]:
            n += 1
            yield kind


def pct(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


# --- the command ------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="bench/chaos.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:4])
        + """

Exit status: 0 when every invariant holds, 1 when one fails (each printed with its
evidence), 2 for a usage mistake.

Examples:
  .venv/bin/python bench/chaos.py --kills 3 --seed 11 --writers 16 --recovery-timeout 15 \
      --shutdown-timeout 8 --op-timeout 45          # as tests/bench/test_chaos.py runs it
  .venv/bin/python bench/chaos.py --kills 50 --seed 7 --writers 32    # the long run
  .venv/bin/python bench/chaos.py --kills 20 --kinds pg-sigkill,pg-freeze
  DATABASE_URL=postgresql://… .venv/bin/python bench/chaos.py --database-url "$DATABASE_URL"
      (a scratch database: the config is applied to it; only server kills apply there)""",
    )
    add = parser.add_argument
    add("--kills", type=int, default=5, help="how many kills (default 5)")
    add(
        "--seed",
        type=int,
        default=None,
        help="chooses kill kinds, moments and the writers' operations (default: random, printed)",
    )
    add(
        "--writers",
        type=int,
        default=24,
        help="concurrent writers, 16-32 is the intended load (default 24)",
    )
    add(
        "--database-url",
        default=None,
        help="serve on this PostgreSQL instead of dev's "
        "embedded one (better-compute dev --database-url); PostgreSQL kills are then skipped",
    )
    add(
        "--kinds",
        default=None,
        help=f"comma-separated subset of {', '.join(KINDS)} (default: all that apply)",
    )
    add("--sim", type=int, default=8, help="simulated 8-GPU nodes (default 8)")
    add("--warmup", type=float, default=2.0, help="seconds of load before the first kill")
    add(
        "--min-gap",
        type=float,
        default=1.5,
        help="least seconds between a recovery and the next kill (default 1.5)",
    )
    add("--max-gap", type=float, default=4.0, help="most seconds between them (default 4)")
    add("--freeze-max", type=float, default=3.0, help="longest PostgreSQL freeze, s (default 3)")
    add("--tail", type=float, default=2.0, help="seconds of load after the last kill")
    add(
        "--settle",
        type=float,
        default=10.0,
        help="seconds the reconciler gets after the load "
        "before stuck work is a failure (default 10)",
    )
    add(
        "--recovery-timeout",
        type=float,
        default=30.0,
        help="seconds a kill may take to recover (default 30)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=15.0,
        help="seconds a Ctrl-C may take (default 15)",
    )
    add(
        "--op-timeout",
        type=float,
        default=60.0,
        help="seconds a writer retries one operation before giving up (default 60)",
    )
    add(
        "--request-timeout",
        type=float,
        default=10.0,
        help="seconds one HTTP attempt may take (default 10)",
    )
    add(
        "--no-check-each",
        dest="check_each",
        action="store_false",
        help="skip the SQL invariants after each kill",
    )
    add(
        "--state-dir",
        type=Path,
        default=None,
        help="keep the state and server logs here (default: a temporary dir, removed)",
    )
    add("--keep", action="store_true", help="keep the temporary dir")
    add(
        "--json",
        dest="json_path",
        type=Path,
        default=None,
        help="also write the figures and invariants to this file",
    )
    add("--budget", type=float, default=150.0, help="globex's GPU-hour budget (default 150)")
    a = parser.parse_args(argv)
    allowed = SERVER_KINDS if a.database_url else KINDS
    kinds = tuple(k.strip() for k in a.kinds.split(",")) if a.kinds else allowed
    for k in kinds:
        if k not in allowed:
            parser.error(f"--kinds: {k!r} is not one of {', '.join(allowed)}")
    if not 1 <= a.writers <= 64:
        parser.error("--writers: between 1 and 64")
    if a.kills < 0 or a.sim < 1 or a.min_gap < 0 or a.max_gap < a.min_gap:
        parser.error("--kills >= 0, --sim >= 1 and 0 <= --min-gap <= --max-gap")
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1_000_000)
    return Options(
        kills=a.kills,
        seed=seed,
        writers=a.writers,
        database_url=a.database_url,
        kinds=kinds,
        sim=a.sim,
        warmup=a.warmup,
        min_gap=a.min_gap,
        max_gap=a.max_gap,
        freeze_max=a.freeze_max,
        tail=a.tail,
        settle=a.settle,
        recovery_timeout=a.recovery_timeout,
        shutdown_timeout=a.shutdown_timeout,
        op_timeout=a.op_timeout,
        request_timeout=a.request_timeout,
        check_each=a.check_each,
        state_dir=a.state_dir,
        keep=a.keep,
        json_path=a.json_path,
        budget=a.budget,
    )


async def _still_running(process: psutil.Process, *, within_s: float) -> bool:
    """Whether ``process`` is still running after up to ``within_s``. An exited process that
    its parent (the init process, for PostgreSQL) has not reaped yet is a zombie: it has
    stopped, though ``psutil.Process.is_running`` and ``wait`` still count it."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        if time.monotonic() >= deadline:
            return True
        await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(Chaos(parse(argv)).run())


if __name__ == "__main__":
    sys.exit(main())
