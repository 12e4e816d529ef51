"""Registration with the kubelet: all three resources, and again after the kubelet restarts or
our own socket is deleted, against the kubelet stand-in over real unix sockets."""

from __future__ import annotations

import time

from bettercompute.deviceplugin.registering import Registrar
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node, allocation_spec


async def test_all_three_resources_register_with_their_sockets_and_options(
    running_node: Node,
) -> None:
    kubelet = running_node.kubelet
    requests = {request.resource_name: request for _, request in kubelet.registrations}
    assert set(requests) == {GPU, MIG, SLOT}
    assert {name: r.endpoint for name, r in requests.items()} == {
        GPU: "bcd-gpu.sock",
        MIG: "bcd-gpu-mig.sock",
        SLOT: "bcd-gpu-slot.sock",
    }
    for name, request in requests.items():
        assert request.version == "v1beta1"
        assert request.options.get_preferred_allocation_available is True
        assert request.options.pre_start_required is True
        # The kubelet keeps what GetDevicePluginOptions answered: it must agree.
        assert kubelet.plugins[name].options == request.options
        assert (running_node.plugin_dir / request.endpoint).is_socket()
    # Each stream opened with the complete (still empty) list at once.
    for name in (GPU, MIG, SLOT):
        await running_node.stream(name).wait_devices({})


async def test_a_kubelet_restart_is_followed_by_registration_within_a_second(
    running_node: Node,
) -> None:
    running_node.put(allocation_spec("alloc_a", ["GPU-0"]))
    await running_node.stream(GPU).wait_devices({"GPU-0": "Healthy"})

    restarted = time.monotonic()
    await running_node.kubelet.restart()  # deletes kubelet.sock and our three sockets
    registered = await running_node.kubelet.wait_registered(
        [GPU, MIG, SLOT], after=restarted, within=3.0
    )

    assert registered - restarted < 1.0
    # The new kubelet got the full list on its new stream, from re-created sockets.
    await running_node.stream(GPU).wait_devices({"GPU-0": "Healthy"})
    await running_node.stream(SLOT).wait_devices({})
    assert running_node.plugin is not None
    for server in running_node.plugin.servers:
        assert server.socket_path.is_socket()


async def test_our_deleted_socket_is_served_again_and_registered_again(
    running_node: Node,
) -> None:
    deleted = time.monotonic()
    (running_node.plugin_dir / "bcd-gpu-mig.sock").unlink()

    await running_node.kubelet.wait_registered([MIG], after=deleted)

    assert (running_node.plugin_dir / "bcd-gpu-mig.sock").is_socket()
    again = [r.resource_name for t, r in running_node.kubelet.registrations if t > deleted]
    assert again == [MIG]  # the other two were left alone
    await running_node.stream(MIG).wait_devices({})


async def test_a_plugin_started_before_the_kubelet_registers_once_it_appears(
    kubelet_node: Node,
) -> None:
    await kubelet_node.kubelet.stop()
    plugin = kubelet_node.make_plugin()
    registrar: Registrar = plugin.registrar
    try:
        await plugin.converger.sync_once()
        await registrar.step()
        for server in plugin.servers:
            assert server.socket_path.is_socket()  # serving without a kubelet
        assert registrar.registrations == []  # no kubelet.sock: nothing to register with

        started = time.monotonic()
        await kubelet_node.kubelet.start()
        await registrar.step()

        assert sorted(name for name, _ in registrar.registrations) == [GPU, MIG, SLOT]
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT], after=started)
        await kubelet_node.stream(SLOT).wait_devices({})
    finally:
        for server in plugin.servers:
            await server.stop()
