"""Wire facts from the kubelet fact sheet: method paths, streaming, field numbers, encoded bytes.

The fact sheet is ``shared/reference/kubelet-device-plugin-protocol.md``; every row here is one
of its facts, so a renumbered field or a renamed method fails a test before it fails a kubelet.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from google.protobuf import descriptor, message

from bettercompute.proto.deviceplugin.v1beta1 import api_pb2 as dp
from bettercompute.proto.podresources.v1 import api_pb2 as pr

# (module, full method path, request, response, server-streaming)
METHODS = [
    (dp, "/v1beta1.Registration/Register", "RegisterRequest", "Empty", False),
    (dp, "/v1beta1.DevicePlugin/GetDevicePluginOptions", "Empty", "DevicePluginOptions", False),
    (dp, "/v1beta1.DevicePlugin/ListAndWatch", "Empty", "ListAndWatchResponse", True),
    (
        dp,
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "PreferredAllocationRequest",
        "PreferredAllocationResponse",
        False,
    ),
    (dp, "/v1beta1.DevicePlugin/Allocate", "AllocateRequest", "AllocateResponse", False),
    (
        dp,
        "/v1beta1.DevicePlugin/PreStartContainer",
        "PreStartContainerRequest",
        "PreStartContainerResponse",
        False,
    ),
    (
        pr,
        "/v1.PodResourcesLister/List",
        "ListPodResourcesRequest",
        "ListPodResourcesResponse",
        False,
    ),
    (
        pr,
        "/v1.PodResourcesLister/GetAllocatableResources",
        "AllocatableResourcesRequest",
        "AllocatableResourcesResponse",
        False,
    ),
    (pr, "/v1.PodResourcesLister/Get", "GetPodResourcesRequest", "GetPodResourcesResponse", False),
]

# Every field of every message: message -> {field: number}. Messages with no fields map to {}.
DEVICE_PLUGIN_FIELDS: dict[str, dict[str, int]] = {
    "Empty": {},
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "ListAndWatchResponse": {"devices": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    },
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
    "CDIDevice": {"name": 1},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreStartContainerResponse": {},
}

POD_RESOURCES_FIELDS: dict[str, dict[str, int]] = {
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5},
    "ContainerResources": {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    },
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
    "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "ClaimResource": {
        "cdi_devices": 1,
        "driver_name": 2,
        "pool_name": 3,
        "device_name": 4,
        "share_id": 5,
    },
    "CDIDevice": {"name": 1},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
}

FIELD_TABLES = [("v1beta1", dp, DEVICE_PLUGIN_FIELDS), ("v1", pr, POD_RESOURCES_FIELDS)]


def _method(module: ModuleType, path: str) -> descriptor.MethodDescriptor:
    service_name, method_name = path.strip("/").split("/")
    package, service = service_name.split(".")
    assert module.DESCRIPTOR.package == package
    found: descriptor.MethodDescriptor = module.DESCRIPTOR.services_by_name[
        service
    ].methods_by_name[method_name]
    return found


@pytest.mark.parametrize(
    ("module", "path", "request_type", "response_type", "server_streaming"),
    METHODS,
    ids=[row[1] for row in METHODS],
)
def test_method_paths_types_and_streaming(
    module: ModuleType, path: str, request_type: str, response_type: str, server_streaming: bool
) -> None:
    method = _method(module, path)

    assert f"/{method.containing_service.full_name}/{method.name}" == path
    package = module.DESCRIPTOR.package
    assert method.input_type.full_name == f"{package}.{request_type}"
    assert method.output_type.full_name == f"{package}.{response_type}"
    assert method.server_streaming is server_streaming
    assert method.client_streaming is False


@pytest.mark.parametrize(("module", "services"), [(dp, 2), (pr, 1)])
def test_no_method_beyond_the_fact_sheet(module: ModuleType, services: int) -> None:
    declared = {
        f"/{service.full_name}/{method.name}"
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert len(module.DESCRIPTOR.services_by_name) == services
    assert declared == {row[1] for row in METHODS if row[0] is module}


@pytest.mark.parametrize(
    ("package", "module", "table"), FIELD_TABLES, ids=[row[0] for row in FIELD_TABLES]
)
def test_every_message_and_field_number(
    package: str, module: ModuleType, table: dict[str, dict[str, int]]
) -> None:
    assert set(module.DESCRIPTOR.message_types_by_name) == set(table)
    for name, fields in table.items():
        found = module.DESCRIPTOR.message_types_by_name[name]
        assert found.full_name == f"{package}.{name}"
        actual = {field.name: field.number for field in found.fields}
        assert actual == fields, f"{package}.{name}"


def test_the_removed_dynamic_resource_field_stays_reserved() -> None:
    proto = pr.DynamicResource.DESCRIPTOR.file.serialized_pb
    assert b"class_name" in proto  # reserved by name as well as by number
    assert 1 not in {field.number for field in pr.DynamicResource.DESCRIPTOR.fields}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (dp.Device(ID="GPU-1", health="Healthy"), b"\n\x05GPU-1\x12\x07Healthy"),
        (
            dp.RegisterRequest(
                version="v1beta1", endpoint="bcd-gpu.sock", resource_name="bcd.dev/gpu"
            ),
            b"\n\x07v1beta1\x12\x0cbcd-gpu.sock\x1a\x0bbcd.dev/gpu",
        ),
        # Field 5, length-delimited: tag (5 << 3) | 2 = 0x2a.
        (
            dp.ContainerAllocateResponse(cdi_devices=[dp.CDIDevice(name="bcd.dev/gpu=0")]),
            b"\x2a\x0f\n\x0dbcd.dev/gpu=0",
        ),
        (
            dp.DevicePluginOptions(get_preferred_allocation_available=True),
            b"\x10\x01",
        ),
        (
            dp.Device(ID="0", topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=1)])),
            b"\n\x010\x1a\x04\n\x02\x08\x01",
        ),
        (dp.Empty(), b""),
        (
            pr.ContainerDevices(resource_name="r", device_ids=["a", "b"]),
            b"\n\x01r\x12\x01a\x12\x01b",
        ),
        # proto3 `optional`: an explicitly set empty share_id is still on the wire.
        (pr.ClaimResource(share_id=""), b"\x2a\x00"),
        (pr.AllocatableResourcesResponse(cpu_ids=[2, 3]), b"\x12\x02\x02\x03"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, message.Message) else "",
)
def test_encoded_bytes_match_hand_computed_wire_format(
    value: message.Message, expected: bytes
) -> None:
    assert value.SerializeToString(deterministic=True) == expected
    assert type(value).FromString(expected) == value
