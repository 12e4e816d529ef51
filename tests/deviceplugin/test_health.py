"""Health from NVML's critical XID events: a fake event source stands in for NVML (the boundary),
the real ``XidHealth`` thread and inventory wrapper run, and the change reaches the kubelet and
the GPUNode the way a failed read does. ``test_nvml_events.py`` asks the real NVML."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from bettercompute.deviceplugin import health
from bettercompute.deviceplugin.agent import started
from bettercompute.deviceplugin.health import (
    EventSourceError,
    HealthChecked,
    Registration,
    XidEvent,
    XidHealth,
)
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node, allocation_spec, inventory
from tests.support.kubeserver import KubeApi

WATCHED = ("GPU-0", "GPU-1", "GPU-2", "GPU-3", "GPU-4")


class FakeXidEvents:
    """The event-source boundary in memory: the test queues events and failures; ``open`` can
    be made to fail a number of times first."""

    def __init__(
        self,
        registration: Registration | None = None,
        *,
        open_failures: int = 0,
    ) -> None:
        self.registration = registration or Registration(watched=WATCHED)
        self.open_failures = open_failures
        self.items: queue.Queue[XidEvent | Exception] = queue.Queue()
        self.opened = 0
        self.closed = 0
        self.is_open = threading.Event()

    def open(self) -> Registration:
        if self.open_failures:
            self.open_failures -= 1
            raise EventSourceError("NVML did not initialise: Driver Not Loaded")
        self.opened += 1
        self.is_open.set()
        return self.registration

    def wait(self, timeout_s: float) -> XidEvent | None:
        try:
            item = self.items.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.closed += 1
        self.is_open.clear()

    def send(self, xid: int, uuid: str | None) -> None:
        self.items.put(XidEvent(xid=xid, uuid=uuid))

    def fail(self, reason: str | Exception) -> None:
        self.items.put(EventSourceError(reason) if isinstance(reason, str) else reason)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def eventually(condition: Callable[[], bool], *, within: float = 2.0) -> None:
    """Until the event thread has done what ``condition`` checks (it runs on its own)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the XID thread did not get there in time")
        time.sleep(0.005)


@pytest.fixture
def events() -> FakeXidEvents:
    return FakeXidEvents()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def watcher(events: FakeXidEvents, clock: Clock) -> Iterator[XidHealth]:
    xid = XidHealth(events, skip=health.SKIPPED_XIDS | {48}, wait_s=0.01, retry_s=0.01, clock=clock)
    xid.start()
    events.is_open.wait(2.0)
    yield xid
    xid.stop()


def test_a_critical_xid_makes_its_gpu_unhealthy_and_says_why(
    events: FakeXidEvents, watcher: XidHealth
) -> None:
    events.send(79, "GPU-1")
    eventually(lambda: "GPU-1" in watcher.unhealthy())

    judged = watcher.apply(inventory())

    sick = [gpu for gpu in judged.gpus if not gpu.healthy]
    assert [gpu.uuid for gpu in sick] == ["GPU-1"]
    assert sick[0].problem is not None
    assert sick[0].problem.startswith("critical XID 79 at ")
    assert sick[0].problem.endswith("healthy again after 300s of good reads without another")
    assert judged.gpus[0] == inventory().gpus[0]  # the others untouched


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109, 48])
def test_application_faults_and_configured_xids_are_skipped(
    events: FakeXidEvents, watcher: XidHealth, xid: int
) -> None:
    events.send(xid, "GPU-0")
    events.send(94, "GPU-3")  # a contained ECC error after it: seen once the first was
    eventually(lambda: "GPU-3" in watcher.unhealthy())

    assert watcher.events_seen == 2
    assert set(watcher.unhealthy()) == {"GPU-3"}


def test_a_gpu_recovers_after_good_reads_for_the_recovery_time(
    events: FakeXidEvents, watcher: XidHealth, clock: Clock
) -> None:
    def healthy(uuid: str, *, read_fails: bool = False) -> bool:
        read = inventory(unhealthy=[uuid] if read_fails else [])
        return next(g for g in watcher.apply(read).gpus if g.uuid == uuid).healthy

    events.send(79, "GPU-2")
    eventually(lambda: "GPU-2" in watcher.unhealthy())
    assert not healthy("GPU-2")  # the first good read starts the wait
    clock.now += 200
    assert not healthy("GPU-2")
    assert not healthy("GPU-2", read_fails=True)  # a failed read starts it again
    clock.now += 10
    assert not healthy("GPU-2")
    clock.now += 299
    assert not healthy("GPU-2")
    events.send(79, "GPU-2")  # a new XID meanwhile: the wait starts again too
    eventually(lambda: watcher.events_seen == 2)
    clock.now += 100
    assert not healthy("GPU-2")
    clock.now += 299
    assert not healthy("GPU-2")
    clock.now += 1
    assert healthy("GPU-2")
    assert watcher.unhealthy() == {}


def test_an_event_on_no_named_gpu_marks_every_watched_one() -> None:
    events = FakeXidEvents(
        Registration(watched=("GPU-0", "GPU-1"), unsupported=(("GPU-2", "too old"),))
    )
    xid = XidHealth(events, wait_s=0.01)
    xid.start()
    try:
        events.send(79, None)
        eventually(lambda: bool(xid.unhealthy()))
        assert set(xid.unhealthy()) == {"GPU-0", "GPU-1"}
        assert "on an unnamed GPU" in xid.unhealthy()["GPU-0"]
        assert xid.registration is not None
        assert xid.registration.unsupported == (("GPU-2", "too old"),)
    finally:
        xid.stop()


def test_a_failed_wait_marks_every_watched_gpu_and_the_events_are_opened_again(
    events: FakeXidEvents, watcher: XidHealth
) -> None:
    events.fail("waiting for NVML events: GPU is lost")
    eventually(lambda: events.opened == 2)

    assert set(watcher.unhealthy()) == set(WATCHED)
    assert watcher.unhealthy()["GPU-4"].startswith(
        "the NVML event wait failed: waiting for NVML events: GPU is lost"
    )
    assert events.closed == 1
    events.send(79, "GPU-0")  # watching again
    eventually(lambda: watcher.events_seen == 1)


def test_a_fault_of_the_watcher_itself_marks_nothing_and_it_watches_again(
    events: FakeXidEvents, watcher: XidHealth, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger=health.__name__):
        events.fail(RuntimeError("a bug"))
        eventually(lambda: events.opened == 2)

    assert watcher.unhealthy() == {}
    assert "the XID watcher failed" in caplog.text
    events.send(79, "GPU-0")
    eventually(lambda: "GPU-0" in watcher.unhealthy())


def test_events_that_cannot_be_opened_are_retried_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = FakeXidEvents(open_failures=3)
    xid = XidHealth(events, wait_s=0.01, retry_s=0.01)
    with caplog.at_level(logging.WARNING, logger=health.__name__):
        xid.start()
        try:
            eventually(lambda: events.opened == 1)
        finally:
            xid.stop()

    said = [r.getMessage() for r in caplog.records if "cannot watch NVML events" in r.message]
    assert said == [
        "cannot watch NVML events, health comes from reads only: NVML did not initialise: "
        "Driver Not Loaded; retrying every 0.01s"
    ]
    assert events.closed == 1  # stopping closed what it opened
    assert xid.unhealthy() == {}  # not being able to watch says nothing about the GPUs


# --- the running node -------------------------------------------------------------------------


@pytest.fixture
async def xid_node(kubelet_node: Node, events: FakeXidEvents) -> AsyncIterator[Node]:
    """The node plugin over the inventory file judged by XID events, recovering in 0.3 s."""
    xid = XidHealth(events, wait_s=0.01, recovery_s=0.3)
    xid.start()
    kubelet_node.plugin = kubelet_node.make_plugin(
        inventory_source=HealthChecked(kubelet_node.file_source(), xid)
    )
    try:
        async with kubelet_node.plugin.running():
            await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
            yield kubelet_node
    finally:
        await asyncio.to_thread(xid.stop)


async def test_an_xid_reaches_the_kubelet_and_the_gpu_recovers(
    xid_node: Node, events: FakeXidEvents
) -> None:
    node = xid_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_mig", ["MIG-4a"], device_class="mig"))
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})

    events.send(79, "GPU-1")
    events.send(48, "GPU-4")  # a double-bit ECC error on the MIG instances' GPU
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Unhealthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Unhealthy"})
    sick_since = time.monotonic()

    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"}, within=3.0)
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"}, within=3.0)
    assert time.monotonic() - sick_since >= 0.25  # not before its reads were good a while
    assert node.reporter.phases("alloc_gpu") == ["Bound"]  # health is not a binding change


async def test_an_xid_shows_on_the_gpunode_with_its_reason(
    kube_api: KubeApi, kubelet_node: Node, events: FakeXidEvents
) -> None:
    def health_of(o: dict[str, object]) -> list[bool]:
        return [g["healthy"] for g in o["status"]["inventory"]["gpus"]]  # type: ignore[index]

    config = agents.agent_config(kube=kube_api, node=kubelet_node)
    async with started(config, xid_events=events):
        gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
        condition = next(c for c in gpunode["status"]["conditions"] if c["type"] == "GpusHealthy")
        assert (condition["status"], condition["reason"]) == ("True", "AllHealthy")

        events.send(79, "GPU-2")
        gpunode = await agents.wait_gpunode(
            kube_api, lambda o: health_of(o) == [True, True, False, True, True]
        )
        condition = next(c for c in gpunode["status"]["conditions"] if c["type"] == "GpusHealthy")
        assert (condition["status"], condition["reason"]) == ("False", "Unhealthy")
        assert condition["message"].startswith("GPU 2 (GPU-2): critical XID 79 at ")
    assert events.closed == 1  # the agent stopped the thread and closed the events


def test_a_simulated_inventory_watches_no_events_unless_given_some(tmp_path) -> None:
    from bettercompute.deviceplugin.agent import AgentConfig, xid_health

    simulated = AgentConfig(node_name="n", inventory_file=tmp_path / "node.yaml")
    assert xid_health(simulated) is None
    assert xid_health(AgentConfig(node_name="n"), None) is not None  # NVML's
    assert xid_health(AgentConfig(node_name="n", xid_health=False)) is None
    given = xid_health(simulated, FakeXidEvents())
    assert given is not None
    assert given.skip == health.SKIPPED_XIDS
