"""The real NVML event path (``health.NvmlXidEvents``), where the driver is present; skipped, with
the reason, where it is not. Only ``health`` and pynvml are imported, so the file also runs on
a GPU machine with the node's dependencies alone (``pytest --noconftest``)."""

from __future__ import annotations

import time

import pytest

from bettercompute.deviceplugin.health import (
    EventSourceError,
    NvmlXidEvents,
    Registration,
    XidEvent,
    XidHealth,
)


def _open_or_skip(source: NvmlXidEvents) -> Registration:
    try:
        return source.open()
    except EventSourceError as e:
        print(f"no NVML here: {e}")
        pytest.skip(f"no NVML here: {e}")


def test_nvml_xid_events_register_wait_and_close_where_the_driver_is_present() -> None:
    import pynvml

    source = NvmlXidEvents()
    registration = _open_or_skip(source)
    try:
        count = pynvml.nvmlDeviceGetCount()
        assert len(registration.watched) + len(registration.unsupported) == count >= 1
        assert all(uuid.startswith("GPU-") for uuid in registration.watched)
        waited_from = time.monotonic()
        event = source.wait(1.0)  # a healthy GPU reports no critical XID in a second
        waited = time.monotonic() - waited_from
        print(f"registration: {registration}; event after {waited:.2f}s: {event}")
        assert event is None or isinstance(event, XidEvent)
        assert event is not None or waited >= 0.9  # a timeout, not an error passed over
    finally:
        source.close()
    with pytest.raises(EventSourceError, match="not open"):
        source.wait(0.01)


def test_the_xid_thread_watches_the_real_gpus_and_stops_promptly() -> None:
    probe = NvmlXidEvents()
    _open_or_skip(probe)
    probe.close()

    xid = XidHealth(NvmlXidEvents(), wait_s=0.2)
    xid.start()
    try:
        deadline = time.monotonic() + 5.0
        while xid.registration is None and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = xid.registration
        assert seen is not None, "the thread never opened NVML's events"
        time.sleep(0.5)  # a few waits go by
    finally:
        stopping = time.monotonic()
        xid.stop()
    assert time.monotonic() - stopping < 2.0
    assert xid.registration is None  # closed on the way out
    print(f"registration: {seen}; unhealthy: {xid.unhealthy()}")


def test_nvml_xid_events_without_a_driver_are_an_event_source_error() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        nvml_message = str(e)
    else:
        pynvml.nvmlShutdown()
        print("NVML initialises here, so there is no failure to check")
        pytest.skip("NVML initialises here, so there is no failure to check")

    with pytest.raises(EventSourceError, match="NVML did not initialise") as caught:
        NvmlXidEvents().open()
    assert nvml_message in str(caught.value)
