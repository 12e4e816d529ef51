"""``kubectl bcd`` as kubectl runs it: the real entry point in a subprocess, with a kubeconfig of
its own, against the Kubernetes API stand-in and the real operator.

The chart's webhook configurations are registered with the stand-in and routed to the
operator's webhook server, so a Reservation the plugin creates is stamped with the identity of
the plugin's token (``alice@acme``), as a real API server would: nothing here stamps by hand.
The tests play the node where one is needed (a ``Bound`` report on the DeviceAllocation), as
``tests/operator/test_allocations.py`` does.

What it must never do: call the plugin's functions in process (the wire and the exit codes are
what is under test), or read a user's own kubeconfig (``HOME`` and ``KUBECONFIG`` are the
test's).
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from bettercompute.operator.running import Operator, started
from bettercompute.store.database import Database
from tests.chart import rendering
from tests.operator.conftest import World, apply_world, operator_config, trust_test_authority
from tests.support import kubeobjects, kubeworld
from tests.support.kubeobjects import DEVICEALLOCATIONS, GPUPOOLS, GPUQUOTAS, RESERVATIONS
from tests.support.kubeserver import KubeApi
from tests.support.policies import CountingPolicy

ALICE = {"username": "alice@acme", "uid": "u-alice", "groups": ["system:authenticated"]}
ALICE_TOKEN = "t-alice"
NS = "ml"
ALLOCATIONS_NS = kubeworld.OPERATOR_NAMESPACE
#: Plenty for a subprocess to start and the operator to answer; a hang fails, not blocks.
RUN_S = 60.0


@dataclass
class Ran:
    code: int
    out: str
    err: str


def plugin_env(home: Path) -> dict[str, str]:
    """The environment of a user with no kubeconfig of their own: only what a test gives."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KUBECONFIG", "KUBERNETES_", "BETTER_COMPUTE_"))
    }
    env["HOME"] = str(home)
    env["COLUMNS"] = "200"
    return env


async def start(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bettercompute.kubectl.app",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def finish(proc: asyncio.subprocess.Process) -> Ran:
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_S)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(f"kubectl-bcd did not finish within {RUN_S}s:\n{out.decode()}{err.decode()}")
    assert proc.returncode is not None
    ran = Ran(proc.returncode, out.decode(), err.decode())
    assert "Traceback" not in ran.err, ran.err
    return ran


class Plugin:
    """``kubectl bcd`` for alice, with a kubeconfig whose context's namespace is ``ml``."""

    def __init__(self, kubeconfig: Path, home: Path) -> None:
        self.kubeconfig = kubeconfig
        self.env = plugin_env(home) | {"KUBECONFIG": str(kubeconfig)}
        self.started: list[asyncio.subprocess.Process] = []

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        proc = await start(*args, env=self.env)
        self.started.append(proc)
        return proc

    async def stop(self) -> None:
        """End what a failed test left running."""
        for proc in self.started:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()

    async def run(self, *args: str) -> Ran:
        return await finish(await self.start(*args))


def write_kubeconfig(path: Path, *, url: str, token: str, namespace: str | None) -> Path:
    context: dict[str, Any] = {"cluster": "stand-in", "user": "alice"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "alice", "user": {"token": token}}],
        "contexts": [{"name": "alice@stand-in", "context": context}],
        "current-context": "alice@stand-in",
    }
    path.write_text(yaml.safe_dump(config))
    return path


# --- the cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart_webhooks() -> list[dict[str, Any]]:
    """The chart's Mutating- and ValidatingWebhookConfiguration, rendered with defaults."""
    chart = helm_python.Chart.load(rendering.CHART)
    try:
        rendered = rendering.render(chart, {})
    finally:
        chart.close()
    return [
        *rendered.of("MutatingWebhookConfiguration"),
        *rendered.of("ValidatingWebhookConfiguration"),
    ]


async def _listening(port: int) -> None:
    """kopf starts its webhook server after discovery: wait until it accepts connections."""
    async with asyncio.timeout(15):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return


@pytest.fixture
async def operator(kube_api: KubeApi, db: Database) -> AsyncIterator[Operator]:
    config = operator_config(kube_api, db)
    await trust_test_authority(kube_api, config)
    async with started(config, db=db, policy=CountingPolicy()) as op:
        await op.ready.wait()
        yield op


@pytest.fixture
async def world(
    kube_api: KubeApi, db: Database, operator: Operator, chart_webhooks: list[dict[str, Any]]
) -> World:
    """A tenant namespace ``ml`` (tenant acme), the pool ``h100`` of one 8-GPU node, and the
    chart's webhooks answering for Reservations: creates are stamped with the caller."""
    world = await apply_world(kube_api, db)
    port = operator.runtime.config.webhook_port
    assert port is not None
    await _listening(port)
    for configuration in chart_webhooks:
        for webhook in configuration["webhooks"]:
            service = webhook["clientConfig"]["service"]
            kube_api.emulator.webhook_services[(service["namespace"], service["name"])] = (
                f"http://127.0.0.1:{port}"
            )
        await kube_api.create(copy.deepcopy(configuration))
    kube_api.tokens[ALICE_TOKEN] = ALICE
    return world


@pytest.fixture
async def plugin(kube_api: KubeApi, tmp_path: Path) -> AsyncIterator[Plugin]:
    kubeconfig = write_kubeconfig(
        tmp_path / "alice.kubeconfig", url=kube_api.url, token=ALICE_TOKEN, namespace=NS
    )
    home = tmp_path / "home"
    home.mkdir()
    plugin = Plugin(kubeconfig, home)
    yield plugin
    await plugin.stop()


# --- helpers -----------------------------------------------------------------------------------


def _state(*states: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") in states


async def _wait_for_a_reservation(kube: KubeApi, within_s: float = 20.0) -> str:
    """The name of the first Reservation in ``ml``, once one exists."""
    async with asyncio.timeout(within_s):
        while True:
            seen = kube.emulator.revision
            names = sorted(o["metadata"]["name"] for o in await kube.list(RESERVATIONS, NS))
            if names:
                return names[0]
            await kube.emulator.written(since=seen)


async def _bind(kube: KubeApi, *, name: str, node: str) -> dict[str, Any]:
    """Play the node: its Bound report on the reservation's DeviceAllocation."""
    placed = await kube.wait_for(
        RESERVATIONS, NS, name, lambda o: bool(((o or {}).get("status") or {}).get("id")), 20
    )
    rid = placed["status"]["id"]
    async with asyncio.timeout(20):
        while True:
            seen = kube.emulator.revision
            mine = [
                a
                for a in await kube.list(DEVICEALLOCATIONS, ALLOCATIONS_NS)
                if a["spec"]["reservationId"] == rid
            ]
            if mine:
                break
            await kube.emulator.written(since=seen)
    (allocation,) = mine
    await kube.patch(
        DEVICEALLOCATIONS,
        ALLOCATIONS_NS,
        allocation["metadata"]["name"],
        {"status": kubeworld.bound(node, allocation["spec"])},
        status=True,
    )
    return allocation


async def _placed(plugin: Plugin, kube: KubeApi, name: str, *args: str) -> dict[str, Any]:
    """A reservation made with ``reserve NAME --no-wait``, once the operator placed it."""
    ran = await plugin.run("reserve", name, "--pool", "h100", *args, "--no-wait")
    assert ran.code == 0, ran.err
    assert ran.out.strip() == name
    placed = await kube.wait_for(RESERVATIONS, NS, name, _state("placed", "binding"), 20)
    assert placed is not None
    return placed


# --- reserve -----------------------------------------------------------------------------------


async def test_reserve_waits_until_ready_and_prints_the_nodes_and_window(
    world: World, plugin: Plugin
) -> None:
    kube, node = world.kube, world.nodes[0]
    proc = await plugin.start("reserve", "--gpus", "2", "--for", "8h", "--nvlink")
    name = await _wait_for_a_reservation(kube)
    created = kube.stored(RESERVATIONS, NS, name)
    # Named by the API server from generateName, in the context's namespace, with the only
    # pool; the spec in the CRD's forms (a duration string), stamped by the webhook as alice.
    assert re.fullmatch(r"rsv-[a-z0-9]+", name), name
    assert created["spec"] == {
        "poolId": "h100",
        "devices": [{"class": "gpu", "count": 2, "topology": "nvlink-all"}],
        "duration": "8h",
    }
    assert created["metadata"]["annotations"]["bcd.dev/requested-by"] == "alice@acme"

    # Placed and binding is not Ready: the plugin keeps waiting until the node binds.
    await kube.wait_for(RESERVATIONS, NS, name, _state("binding"), 20)
    await asyncio.sleep(1.2)  # more than two of the plugin's polls
    assert proc.returncode is None, "reserve returned before the reservation was Ready"
    await _bind(kube, name=name, node=node)
    ran = await finish(proc)

    assert ran.code == 0, ran.err
    ready = kube.stored(RESERVATIONS, NS, name)
    assert ready["status"]["state"] == "active"
    assert f"Reservation {NS}/{name} created" in ran.err
    assert "Pool: h100 (the only GPUPool)" in ran.err
    assert f"{NS}/{name}" in ran.out
    assert re.search(rf"Nodes:\s+{node}\b", ran.out), ran.out
    start = ready["status"]["startTime"][:19]
    end = ready["status"]["endTime"][:19]
    assert re.search(rf"Window:\s+{start}Z to {end}Z", ran.out), ran.out
    assert "active (Ready)" in ran.out


async def test_reserve_with_a_later_start_returns_once_placed(world: World, plugin: Plugin) -> None:
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=2)).replace(microsecond=0)
    start = later.strftime("%Y-%m-%dT%H:%M:%SZ")
    ran = await plugin.run(
        "reserve", "later", "--gpus", "1", "--for", "90m", "--start", start, "-o", "json"
    )
    assert ran.code == 0, ran.err
    obj = json.loads(ran.out)
    assert obj["metadata"]["name"] == "later"
    assert obj["spec"]["start"] == start
    assert obj["spec"]["duration"] == "90m"
    assert obj["status"]["state"] == "placed"
    assert obj["status"]["startTime"] == start


async def test_a_refused_reservation_exits_4_or_5_with_the_operators_reason(
    world: World, plugin: Plugin
) -> None:
    ran = await plugin.run("reserve", "lost", "--pool", "nowhere", "--gpus", "1", "--for", "1h")
    assert ran.code == 4, (ran.out, ran.err)
    stored = world.kube.stored(RESERVATIONS, NS, "lost")
    refused = [c for c in stored["status"]["conditions"] if c["type"] == "Refused"]
    assert refused, stored["status"]
    line = next(li for li in ran.err.splitlines() if li.startswith("Error:"))
    assert line == (
        f"Error: Reservation {NS}/lost: refused: {refused[0]['reason']}: {refused[0]['message']}"
    )
    assert ran.out == ""


async def test_a_reservation_that_can_never_fit_exits_5_saying_so(
    world: World, plugin: Plugin
) -> None:
    # One node of 8 GPUs: 9 on one node can never fit, however long it waits.
    ran = await plugin.run("reserve", "huge", "--gpus", "9", "--for", "1h", "--timeout", "30s")
    assert ran.code == 5, (ran.out, ran.err)
    assert f"Error: Reservation {NS}/huge: it cannot be placed: never fits this pool" in ran.err
    assert world.kube.stored(RESERVATIONS, NS, "huge")["status"]["state"] == "pending"


async def test_a_wait_that_runs_out_exits_7_saying_what_it_waits_for(
    world: World, plugin: Plugin
) -> None:
    # Nobody plays the node: the reservation stays binding, never Ready.
    ran = await plugin.run("reserve", "slow", "--gpus", "1", "--for", "1h", "--timeout", "3s")
    assert ran.code == 7, (ran.out, ran.err)
    assert f"Error: timed out after 3s waiting for Reservation {NS}/slow to be Ready" in ran.err
    assert "it is binding" in ran.err


async def test_the_api_servers_own_refusal_is_one_line_naming_the_object(
    world: World, plugin: Plugin
) -> None:
    # The CRD's schema refuses the profile (422), before the operator ever sees the object.
    ran = await plugin.run(
        "reserve", "bad", "--class", "mig", "--profile", "huge", "--gpus", "1", "--for", "1h"
    )
    assert ran.code == 2, (ran.out, ran.err)
    (line,) = [li for li in ran.err.splitlines() if li.startswith("Error")]
    assert line.startswith(f"Error: create Reservation {NS}/bad: invalid (422): ")
    assert "profile" in line
    assert world.kube.stored(RESERVATIONS, NS, "bad") is None


async def test_options_that_make_no_request_are_usage_errors_naming_the_option(
    plugin: Plugin,
) -> None:
    # No cluster is asked: the kubeconfig's server is never reached.
    ran = await plugin.run("reserve", "--gpus", "2", "--for", "8 hours")
    assert ran.code == 2
    assert "--for" in ran.err
    ran = await plugin.run("reserve", "--gpus", "2", "--for", "1h", "--class", "mig")
    assert ran.code == 2
    assert "--mig" in ran.err
    ran = await plugin.run("reserve", "--for", "1h", "--start", "tomorrow")
    assert ran.code == 2
    assert "--start" in ran.err
    assert "RFC 3339" in ran.err


# --- get ---------------------------------------------------------------------------------------


async def test_get_shows_the_row_with_real_times_and_one_with_its_conditions(
    world: World, plugin: Plugin
) -> None:
    placed = await _placed(plugin, world.kube, "train", "--gpus", "2", "--for", "8h")
    node = world.nodes[0]
    ran = await plugin.run("get")
    assert ran.code == 0, ran.err
    header, *rows = ran.out.strip().splitlines()
    assert header.split() == ["NAME", "STATE", "READY", "GPUS", "POOL", "END"]
    (row,) = rows
    assert "<invalid>" not in ran.out
    assert max(len(line) for line in ran.out.splitlines()) <= 100, ran.out
    start = placed["status"]["startTime"][:19]
    end = placed["status"]["endTime"][:19]
    assert re.match(
        rf"train\s+(placed|binding)\s+False\s+2\s+h100\s+{end}Z \(in (7h|8h)\)$", row
    ), row

    wide = await plugin.run("get", "-o", "wide")
    assert wide.code == 0, wide.err
    header, row = wide.out.strip().splitlines()
    assert header.split() == [
        *["NAME", "STATE", "READY", "GPUS", "POOL", "NODES", "START", "END", "ID"]
    ]
    assert re.match(
        rf"train\s+(placed|binding)\s+False\s+2\s+h100\s+{node}\s+{start}Z \((now|\d+m ago)\)\s+"
        rf"{end}Z \(in (7h|8h)\)\s+{placed['status']['id']}$",
        row,
    ), row

    one_row = await plugin.run("get", "train", "-o", "wide")
    assert one_row.out.splitlines()[0] == wide.out.splitlines()[0]
    assert one_row.out.split()[-1] == placed["status"]["id"]

    detail = await plugin.run("get", "train", "-n", NS)
    assert detail.code == 0, detail.err
    assert re.search(r"Pool:\s+h100", detail.out)
    assert re.search(r"Devices:\s+2 gpu", detail.out)
    assert re.search(r"Requested by:\s+alice@acme", detail.out)
    assert "Conditions:" in detail.out
    assert re.search(r"^Placed\s+True\s+Booked\s+", detail.out, re.MULTILINE), detail.out
    assert re.search(r"^Ready\s+False\s+", detail.out, re.MULTILINE), detail.out

    as_json = await plugin.run("get", "train", "-o", "json")
    assert json.loads(as_json.out)["status"]["id"] == placed["status"]["id"]
    listed = yaml.safe_load((await plugin.run("get", "-o", "yaml")).out)
    assert [o["metadata"]["name"] for o in listed["items"]] == ["train"]

    # kubectl's jsonpath templates, on one object and on the list.
    one = await plugin.run("get", "train", "-o", "jsonpath={.spec.poolId}/{.status.gpus}")
    assert one.code == 0, one.err
    assert one.out == "h100/2"
    every = await plugin.run(
        "get", "-o", 'jsonpath={range .items[*]}{.metadata.name}{"\\t"}{.status.id}{"\\n"}{end}'
    )
    assert every.out == f"train\t{placed['status']['id']}\n"
    picked = await plugin.run(
        "get", "-o", 'jsonpath={.items[?(@.spec.poolId=="h100")].metadata.name}'
    )
    assert picked.out == "train"
    pools = await plugin.run("pools", "-o", "jsonpath={.items[*].spec.model}")
    assert pools.out == "H100"
    for bad, said in (
        ("jsonpath={.items[", "unbalanced braces"),
        ("jsonpath={range .items[*]}", "without its {end}"),
        ("jsonpath={metadata.name}", "a path starts with ."),
        ("jsonpath", "jsonpath needs a template"),
        ("jsonpath={.items[?(@.a==)]}", "jsonpath={.items[?(@.a==)]}"),
        ("xml", "is not one of: table, wide, yaml, json, name, jsonpath=TEMPLATE"),
    ):
        ran = await plugin.run("get", "-o", bad)
        assert ran.code == 2, (bad, ran.err)
        assert "'--output'" in ran.err, ran.err
        assert said in " ".join(ran.err.split()), ran.err


async def test_output_name_is_kind_dot_group_slash_name_as_kubectl_prints_it(
    world: World, plugin: Plugin
) -> None:
    created = await plugin.run(
        "reserve",
        "named",
        "--pool",
        "h100",
        "--gpus",
        "1",
        "--for",
        "1h",
        "--no-wait",
        "-o",
        "name",
    )
    assert created.code == 0, created.err
    assert created.out == "reservation.bcd.dev/named\n"
    for args in (("get",), ("get", "named"), ("get", "-A")):
        ran = await plugin.run(*args, "-o", "name")
        assert ran.code == 0, ran.err
        assert ran.out == "reservation.bcd.dev/named\n", args
    pools = await plugin.run("pools", "-o", "name")
    assert pools.out == "gpupool.bcd.dev/h100\n"
    quotas = await plugin.run("quota", "-o", "name")
    assert quotas.out == "gpuquota.bcd.dev/acme\n"


async def test_get_selects_by_label_and_lists_every_namespace_with_a_namespace_column(
    world: World, plugin: Plugin
) -> None:
    for name, team in (("vision", "a"), ("speech", "b"), ("plain", None)):
        await _placed(plugin, world.kube, name, "--gpus", "1", "--for", "1h")
        if team is not None:
            await world.kube.patch(RESERVATIONS, NS, name, {"metadata": {"labels": {"team": team}}})

    async def names(*args: str) -> list[str]:
        ran = await plugin.run("get", *args, "-o", "name")
        assert ran.code == 0, ran.err
        return [line.removeprefix("reservation.bcd.dev/") for line in ran.out.split()]

    assert await names("-l", "team=a") == ["vision"]
    assert await names("--selector", "team in (a,b)") == ["speech", "vision"]
    assert await names("-l", "team,team!=a") == ["speech"]
    assert await names("-l", "!team") == ["plain"]
    assert await names("-A", "-l", "team notin (a)") == ["plain", "speech"]
    none = await plugin.run("get", "-l", "team=c")
    assert none.code == 0
    assert none.err.strip() == f"No reservations matching team=c in namespace {NS}."

    every = await plugin.run("get", "-A", "-l", "team=b")
    assert every.code == 0, every.err
    header, row = every.out.strip().splitlines()
    assert header.split()[:2] == ["NAMESPACE", "NAME"]
    assert row.split()[:2] == [NS, "speech"]

    for bad in ("team in a", "team=a,", "=a", "a==b==c"):
        ran = await plugin.run("get", "-l", bad)
        assert ran.code == 2, (bad, ran.err)
        assert "--selector" in ran.err, ran.err
        assert "Traceback" not in ran.err
    both = await plugin.run("get", "vision", "-l", "team=a")
    assert both.code == 2
    assert "give NAME or --selector, not both" in both.err


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line, "the watch ended"
    return line.decode()


async def _until(proc: asyncio.subprocess.Process, wanted: str) -> list[str]:
    """The lines up to and including ``wanted`` (the operator's own status writes are changes
    too, so other lines may come first)."""
    lines = [await _line(proc)]
    while lines[-1] != wanted:
        lines.append(await _line(proc))
    return lines


async def test_get_watch_prints_each_change_until_interrupted(world: World, plugin: Plugin) -> None:
    await _placed(plugin, world.kube, "first", "--gpus", "1", "--for", "1h")
    rows = await plugin.start("get", "-w")
    names = await plugin.start("get", "-w", "-o", "name", "-l", "team=a")
    state = await plugin.start("get", "first", "-w", "-o", "jsonpath={.metadata.labels.team}")
    assert (await _line(rows)).split()[:2] == ["NAME", "STATE"]
    assert (await _line(rows)).split()[0] == "first"
    assert await _line(state) == "\n"
    assert names.stderr is not None  # listed, and nothing matched: watching
    said = await asyncio.wait_for(names.stderr.readline(), 20)
    assert said.decode().startswith("No reservations in namespace ml yet; watching (Ctrl-C stops)")

    await world.kube.patch(RESERVATIONS, NS, "first", {"metadata": {"labels": {"team": "a"}}})
    assert await _line(names) == "reservation.bcd.dev/first\n"
    assert set(await _until(state, "a\n")) <= {"\n", "a\n"}
    await _placed(plugin, world.kube, "second", "--gpus", "1", "--for", "1h")
    async with asyncio.timeout(20):
        while (await _line(rows)).split()[0] != "second":
            pass

    for proc in (rows, state, names):
        proc.send_signal(signal.SIGINT)
        ran = await finish(proc)
        assert ran.code == 130, ran.err
        assert "Error" not in ran.err, ran.err  # as kubectl: Ctrl-C ends it quietly, exit 130


async def test_get_of_a_missing_reservation_is_one_line_404(world: World, plugin: Plugin) -> None:
    ran = await plugin.run("get", "nope")
    assert ran.code == 4
    assert ran.err.strip() == f"Error: no Reservation {NS}/nope (404)"
    ran = await plugin.run("extend", "nope", "--by", "1h", "-n", "other")
    assert ran.code == 4
    assert ran.err.strip() == "Error: no Reservation other/nope (404)"


async def test_an_empty_namespace_says_so(world: World, plugin: Plugin) -> None:
    ran = await plugin.run("get", "-n", "empty")
    assert ran.code == 0
    assert ran.out == ""
    assert ran.err.strip() == "No reservations in namespace empty."


# --- extend, renew, release --------------------------------------------------------------------


async def test_extend_moves_the_end_and_says_so(world: World, plugin: Plugin) -> None:
    placed = await _placed(plugin, world.kube, "train", "--gpus", "1", "--for", "1h")
    end = placed["status"]["during"]["end"]
    ran = await plugin.run("extend", "train", "--by", "2h")
    assert ran.code == 0, ran.err
    stored = world.kube.stored(RESERVATIONS, NS, "train")
    assert stored["spec"]["extendBy"] == "2h"
    assert stored["spec"]["extendKey"].startswith("kubectl-")
    assert stored["status"]["extension"]["key"] == stored["spec"]["extendKey"]
    assert stored["status"]["extension"]["extended"] is True
    assert stored["status"]["during"]["end"] == end + 2 * 3_600_000
    new_end = stored["status"]["endTime"][:19]
    assert ran.out.startswith(f"reservation.bcd.dev/train extended: it now ends {new_end}Z (in ")

    # Again, to an absolute end: a new key, until in place of extendBy.
    until = dt.datetime.fromisoformat(stored["status"]["endTime"]) + dt.timedelta(hours=1)
    until_text = until.strftime("%Y-%m-%dT%H:%M:%SZ")
    again = await plugin.run("extend", "train", "--until", until_text)
    assert again.code == 0, again.err
    stored = world.kube.stored(RESERVATIONS, NS, "train")
    assert "extendBy" not in stored["spec"]
    assert stored["spec"]["until"] == until_text
    assert stored["status"]["endTime"] == until_text


async def test_an_extend_blocked_by_a_later_booking_exits_6_with_available_until(
    world: World, plugin: Plugin
) -> None:
    # All 8 GPUs: the next booking of the pool blocks any extend.
    first = await _placed(plugin, world.kube, "first", "--gpus", "8", "--for", "1h")
    blocker = (
        dt.datetime.fromisoformat(first["status"]["endTime"]) + dt.timedelta(hours=1)
    ).strftime("%Y-%m-%dT%H:%M:%SZ")
    ran = await plugin.run(
        "reserve", "later", "--gpus", "8", "--for", "1h", "--start", blocker, "--no-wait"
    )
    assert ran.code == 0, ran.err
    await world.kube.wait_for(RESERVATIONS, NS, "later", _state("placed"), 20)
    ran = await plugin.run("extend", "first", "--by", "3h")
    assert ran.code == 6, (ran.out, ran.err)
    stored = world.kube.stored(RESERVATIONS, NS, "first")
    assert stored["status"]["extension"]["extended"] is False
    shown = blocker[:19]
    assert ran.out.startswith(
        "reservation.bcd.dev/first not extended: another booking starts first; its devices"
        f" are free until {shown}Z"
    ), ran.out
    assert stored["status"]["endTime"] == first["status"]["endTime"]


async def test_renew_of_a_lease_waits_for_the_operator(world: World, plugin: Plugin) -> None:
    # The plugin has no --lease: the object is made with one as kubectl apply would.
    obj = kubeworld.reservation("agent").lease(600).obj()
    obj["metadata"]["annotations"] = {}  # stamped by the webhook, as alice's own
    await world.kube.create(obj)
    placed = await world.kube.wait_for(RESERVATIONS, NS, "agent", _state("placed", "binding"), 20)
    ran = await plugin.run("renew", "agent")
    assert ran.code == 0, ran.err
    stored = world.kube.stored(RESERVATIONS, NS, "agent")
    value = stored["metadata"]["annotations"]["bcd.dev/renew"]
    assert stored["status"]["renewed"] == value
    assert dt.datetime.fromisoformat(value) <= dt.datetime.now(dt.UTC)
    assert stored["status"]["leaseExpiresAt"] >= placed["status"]["leaseExpiresAt"]
    assert ran.out.startswith("reservation.bcd.dev/agent renewed: the lease now expires ")


async def test_renew_without_a_lease_exits_6_with_the_refusal(world: World, plugin: Plugin) -> None:
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=3)).strftime("%Y-%m-%dT%H:%M:%SZ")
    await _placed(plugin, world.kube, "plain", "--for", "1h", "--start", later)
    ran = await plugin.run("renew", "plain")
    assert ran.code == 6, (ran.out, ran.err)
    assert ran.err.startswith(
        f"Error: Reservation {NS}/plain: renew refused: INVALID_STATE: renew:"
    )


async def test_release_ends_it_and_keeps_the_object(world: World, plugin: Plugin) -> None:
    await _placed(plugin, world.kube, "train", "--gpus", "2", "--for", "1h")
    ran = await plugin.run("release", "train")
    assert ran.code == 0, ran.err
    stored = world.kube.stored(RESERVATIONS, NS, "train")
    assert stored["spec"]["release"] is True
    assert stored["status"]["state"] in ("released", "cancelled")
    assert ran.out.strip() == f"reservation.bcd.dev/train {stored['status']['state']}"
    again = await plugin.run("release", "train")
    assert again.code == 0
    assert again.out.strip() == f"reservation.bcd.dev/train is already {stored['status']['state']}"


# --- pools, find -------------------------------------------------------------------------------


async def _pool_free(kube: KubeApi, free: int) -> None:
    await kube.wait_for(
        GPUPOOLS,
        None,
        "h100",
        lambda o: (
            ((o or {}).get("status") or {}).get("devices", {}).get("gpu", {}).get("free") == free
        ),
        10,
    )


async def test_pools_shows_what_each_pool_holds_now(world: World, plugin: Plugin) -> None:
    await _pool_free(world.kube, 8)
    ran = await plugin.run("pools")
    assert ran.code == 0, ran.err
    header, row = ran.out.strip().splitlines()
    assert header.split() == ["NAME", "MODEL", "SHARING", "NODES", "FREE", "TOTAL", "NEXT", "FREE"]
    assert row.split() == ["h100", "H100", "exclusive", "1/1", "8", "8", "-"]

    await _placed(plugin, world.kube, "train", "--gpus", "3", "--for", "1h")
    await _pool_free(world.kube, 5)
    ran = await plugin.run("pools")
    assert ran.out.strip().splitlines()[1].split() == [
        "h100",
        "H100",
        "exclusive",
        "1/1",
        "5",
        "8",
        "-",
    ]


async def test_find_says_where_n_are_free_now_or_when_the_pool_frees_one(
    world: World, plugin: Plugin
) -> None:
    await _pool_free(world.kube, 8)
    ran = await plugin.run("find", "--gpus", "4", "--for", "8h", "-o", "json")
    assert ran.code == 0, ran.err
    (found,) = json.loads(ran.out)
    assert (found["pool"], found["free"], found["total"], found["fitsNow"]) == ("h100", 8, 8, True)

    first = await _placed(plugin, world.kube, "all", "--gpus", "8", "--for", "1h")
    await _pool_free(world.kube, 0)
    await world.kube.wait_for(
        GPUPOOLS, None, "h100", lambda o: bool(((o or {}).get("status") or {}).get("nextFreeAt"))
    )
    ran = await plugin.run("find", "--gpus", "4", "--for", "8h", "-o", "json")
    (found,) = json.loads(ran.out)
    assert found["fitsNow"] is False
    assert found["nextFreeAt"] == first["status"]["endTime"]
    assert found["start"] == first["status"]["endTime"]
    table = await plugin.run("find", "--gpus", "4", "--for", "8h")
    assert re.search(r"^h100\s+H100\s+0/8 gpu\s+no\s+", table.out.splitlines()[1]), table.out


# --- help and version ---------------------------------------------------------------------------


async def test_help_teaches_and_version_names_the_package(tmp_path: Path) -> None:
    env = plugin_env(tmp_path)  # neither needs a cluster
    top = await finish(await start("--help", env=env))
    assert top.code == 0
    for command in ("reserve", "get", "extend", "renew", "release", "pools", "find", "quota"):
        assert re.search(rf"^\W*{command}\s", top.out, re.MULTILINE), (command, top.out)
    find = await finish(await start("find", "--help", env=env))
    said = " ".join(find.out.replace("│", " ").split())
    assert "Reads each GPUPool's status only" in said
    assert "capacity search" in said
    assert "is exact" in said
    version = await finish(await start("--version", env=env))
    assert version.code == 0
    assert re.fullmatch(r"kubectl-bcd \S+\n", version.out), version.out


STATEFULSETS = kubeobjects.Ref(group="apps", version="v1", plural="statefulsets", namespaced=True)


async def test_version_names_the_operator_the_cluster_runs(world: World, plugin: Plugin) -> None:
    # The chart's StatefulSet, as it labels it: its image's tag is the operator that runs.
    world.kube.emulator.declare(STATEFULSETS, kind="StatefulSet")
    labels = {
        "app.kubernetes.io/part-of": "better-compute",
        "app.kubernetes.io/component": "operator",
        "app.kubernetes.io/version": "0.9.0",
    }
    containers = [{"name": "operator", "image": "ghcr.io/acme/better-compute:1.4.2"}]
    await world.kube.create(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "bcd-operator", "namespace": "bcd-system", "labels": labels},
            "spec": {
                "serviceName": "bcd-operator",
                "selector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
                "template": {"spec": {"containers": containers}},
            },
        }
    )
    ran = await plugin.run("--version")
    assert ran.code == 0, ran.err
    assert re.fullmatch(
        r"kubectl-bcd \S+\noperator 1\.4\.2 \(StatefulSet bcd-system/bcd-operator\)\n", ran.out
    ), ran.out
    # Without a cluster: its own version, and why there is no operator's, on stderr.
    alone = await finish(await start("--version", env=plugin_env(plugin.kubeconfig.parent)))
    assert alone.code == 0, alone.err
    assert re.fullmatch(r"kubectl-bcd \S+\n", alone.out), alone.out
    assert alone.err.startswith("(no operator version: "), alone.err


async def test_get_all_namespaces_lists_every_namespace(world: World, plugin: Plugin) -> None:
    await world.kube.create(kubeworld.namespace("vision", tenant="acme"))
    await _placed(plugin, world.kube, "here", "--gpus", "1", "--for", "1h")
    ran = await plugin.run(
        "reserve", "there", "--gpus", "1", "--for", "1h", "-n", "vision", "--no-wait"
    )
    assert ran.code == 0, ran.err
    every = await plugin.run("get", "-A", "-o", "name")
    assert every.code == 0, every.err
    assert every.out.split() == ["reservation.bcd.dev/here", "reservation.bcd.dev/there"]
    table = await plugin.run("get", "-A")
    rows = [line.split()[:2] for line in table.out.strip().splitlines()[1:]]
    assert rows == [[NS, "here"], ["vision", "there"]], table.out


# --- credentials and identity ------------------------------------------------------------------


async def test_without_a_kubeconfig_it_says_so_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    ran = await finish(await start("get", env=plugin_env(home)))
    assert ran.code == 2
    (line,) = ran.err.strip().splitlines()
    assert line.startswith("Error: no kubeconfig: set $KUBECONFIG or pass --kubeconfig")
    missing = await finish(
        await start("pools", "--kubeconfig", str(tmp_path / "absent"), env=plugin_env(home))
    )
    assert missing.code == 2
    (line,) = missing.err.strip().splitlines()
    assert line.startswith(f"Error: kubeconfig {tmp_path / 'absent'}: cannot read")


async def test_an_unknown_context_is_named(world: World, plugin: Plugin) -> None:
    ran = await plugin.run("--context", "prod", "get")
    assert ran.code == 2
    assert "--context prod: " in ran.err
    assert "alice@stand-in" in ran.err


async def test_an_unreachable_api_server_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    kubeconfig = write_kubeconfig(
        tmp_path / "k", url="http://127.0.0.1:9", token="t", namespace=None
    )
    ran = await finish(await start("get", "--kubeconfig", str(kubeconfig), env=plugin_env(home)))
    assert ran.code == 3
    (line,) = ran.err.strip().splitlines()
    assert line.startswith("Error: cannot reach the Kubernetes API server http://127.0.0.1:9")


async def test_a_namespace_the_identity_may_not_write_is_forbidden_in_one_line(
    world: World, plugin: Plugin
) -> None:
    # The stand-in authorizes every caller (it has no RBAC): it answers here as the API
    # server's RBAC authorizer does for a user without create on reservations in 'locked'.
    path = RESERVATIONS.path(namespace="locked")
    message = (
        'reservations.bcd.dev is forbidden: User "alice@acme" cannot create resource'
        ' "reservations" in API group "bcd.dev" in the namespace "locked"'
    )
    world.kube.emulator[f"post {path}"] << kubeobjects.failure(403, "Forbidden", message)
    ran = await plugin.run("reserve", "--pool", "h100", "--for", "1h", "-n", "locked")
    assert ran.code == 5
    (line,) = ran.err.strip().splitlines()
    assert line == (
        "Error: forbidden (403): your identity may not create reservations in namespace"
        f" locked ({message})"
    )


# --- quota -------------------------------------------------------------------------------------


async def test_quota_shows_the_namespaces_tenant_used_limit_and_free(
    world: World, plugin: Plugin
) -> None:
    # The world gave acme 64 H100s; beta gets its own quota, which acme's namespace hides.
    await world.kube.create(
        {
            "apiVersion": "bcd.dev/v1alpha1",
            "kind": "GPUQuota",
            "metadata": {"name": "beta"},
            "spec": {"tenant": "beta", "limits": {"gpu:H100": 4, "vcpu": 256}},
        }
    )
    await _placed(plugin, world.kube, "train", "--gpus", "3", "--for", "1h")
    for name, used in (("acme", 3), ("beta", 0)):
        await world.kube.wait_for(
            GPUQUOTAS,
            None,
            name,
            lambda o, used=used: (
                ((o or {}).get("status") or {}).get("used", {}).get("gpu:H100", 0) == used
                and "gpu:H100" in ((o or {}).get("status") or {}).get("limits", {})
            ),
            10,
        )
    ran = await plugin.run("quota")
    assert ran.code == 0, ran.err
    assert "Tenant acme (label bcd.dev/tenant of namespace ml)" in ran.err
    rows = [line.split() for line in ran.out.strip().splitlines()]
    assert rows == [
        ["TENANT", "RESOURCE", "USED", "LIMIT", "FREE"],
        ["acme", "gpu:H100", "3", "64", "61"],
    ]
    beta = await plugin.run("quota", "beta")
    assert [line.split() for line in beta.out.strip().splitlines()][1:] == [
        ["beta", "gpu:H100", "0", "4", "4"],
        ["beta", "vcpu", "0", "256", "256"],
    ]
    # A namespace without a tenant label: every quota the identity may list.
    everyone = await plugin.run("quota", "-n", "default")
    assert "has no bcd.dev/tenant label; showing all" in everyone.err
    assert [row.split()[0] for row in everyone.out.strip().splitlines()[1:]] == [
        "acme",
        "beta",
        "beta",
    ]
