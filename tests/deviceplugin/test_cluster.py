"""The node's Kubernetes side piece by piece against the API stand-in over HTTP: credentials,
the DeviceAllocation adapter (list, watch, resume, report) and the GPUNode publisher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
import yaml
from prometheus_client import CollectorRegistry

from bettercompute.deviceplugin.agent import AgentError, started
from bettercompute.deviceplugin.allocations import Allocations
from bettercompute.deviceplugin.publishing import NodePublisher, parse_labels
from bettercompute.deviceplugin.watching import AllocationObjects
from bettercompute.kube.client import (
    CredentialsError,
    KubeClient,
    KubeError,
    kube_config,
    read_kubeconfig,
    server_of,
)
from bettercompute.kube.resources import DEVICE_ALLOCATIONS
from bettercompute.kube.resources import GPUNODES as GPUNODES_RESOURCE
from tests.deviceplugin import agents
from tests.deviceplugin.agents import OPERATOR_NAMESPACE as NS
from tests.deviceplugin.conftest import NODE, Node, allocation_spec, inventory
from tests.support.kubeobjects import DEVICEALLOCATIONS, GPUNODES, Ref
from tests.support.kubeserver import KubeApi

NODES = Ref(group="", version="v1", plural="nodes", namespaced=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def client(kube_api: KubeApi) -> AsyncIterator[KubeClient]:
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    async with KubeClient(config) as opened:
        yield opened


def exec_kubeconfig(
    folder: Path, *, server: str, plugin: Path, args: list[str] | None = None
) -> Path:
    """A kubeconfig whose user gets its token from ``plugin``, as EKS, GKE and AKS write them."""
    exec_ = {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}
    if args:
        exec_["args"] = args
    config = folder / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"exec": exec_}}],
            }
        )
    )
    return config


def publisher(client: KubeClient, **options) -> NodePublisher:
    return NodePublisher(client=client, node_name=NODE, registry=CollectorRegistry(), **options)


# --- credentials -------------------------------------------------------------------------------


def test_credentials_come_from_the_flag_then_kubeconfig_then_the_service_account(
    tmp_path: Path,
):
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("sa-token\n")
    (account / "ca.crt").write_text("not read here")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}

    explicit, where = kube_config(api_server="http://127.0.0.1:1/", api_token="t", environ=env)
    assert (server_of(explicit), where) == ("http://127.0.0.1:1", "--api-server")
    assert explicit.get().user.token == "t"

    in_pod, where = kube_config(service_account_dir=account, environ=env)
    assert server_of(in_pod) == "https://[fd00::1]:6443"
    assert where == f"the service account in {account}"
    current = in_pod.get()
    # The token is read from its file for each request (the kubelet rotates it), never kept.
    assert (current.user.token, current.user.token_file) == (None, str(account / "token"))
    assert current.cluster.certificate_auth == str(account / "ca.crt")
    default, _ = kube_config(service_account_dir=account, environ={})
    assert server_of(default) == "https://kubernetes.default.svc"

    config = tmp_path / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [
                    {
                        "name": "k",
                        "cluster": {"server": "https://k:6443", "certificate-authority": "ca.pem"},
                    }
                ],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
            }
        )
    )
    from_file, where = kube_config(
        service_account_dir=account, environ={**env, "KUBECONFIG": str(config)}
    )
    assert server_of(from_file) == "https://k:6443"
    assert where == f"kubeconfig {config} (context 'c')"

    with pytest.raises(CredentialsError, match="no Kubernetes API server"):
        kube_config(service_account_dir=tmp_path / "none", environ={"HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("[a, b", "kubeconfig .*: "),
        ("{}", "kubeconfig .*: "),
        ("{current-context: x, contexts: [], clusters: []}", "kubeconfig .*: .*'x'"),
        (
            "{current-context: c, contexts: [{name: c, context: {cluster: k}}],"
            " clusters: [{name: k, cluster: {}}]}",
            "kubeconfig .*: ",
        ),
    ],
)
def test_a_kubeconfig_it_cannot_use_is_a_clear_error(tmp_path: Path, document: str, problem: str):
    path = tmp_path / "kubeconfig"
    path.write_text(document)
    with pytest.raises(CredentialsError, match=problem):
        read_kubeconfig(path)


@pytest.mark.parametrize(
    "authority",
    [
        {"certificate-authority": "missing-ca.pem"},
        {"certificate-authority-data": "bm90IGEgY2VydA=="},
    ],
)
async def test_a_certificate_authority_it_cannot_load_stops_the_agent_with_one_line(
    kubelet_node: Node, tmp_path: Path, authority: dict[str, str]
):
    config = tmp_path / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [
                    {"name": "k", "cluster": {"server": "https://127.0.0.1:1", **authority}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    settings = agents.agent_config(kube=None, node=kubelet_node, kubeconfig=config)
    with pytest.raises(AgentError) as failed:
        async with started(settings):
            pass
    said = str(failed.value)
    assert said.startswith(f"kubeconfig {config} (context 'c'): cannot load its TLS certificate")
    assert "\n" not in said


async def test_a_kubeconfig_with_an_exec_plugin_authenticates_as_eks_gke_and_aks_do(
    kube_api: KubeApi, tmp_path: Path
):
    # What EKS (aws eks get-token), GKE (gke-gcloud-auth-plugin) and AKS (kubelogin) put in a
    # kubeconfig: a command that prints an ExecCredential. The agent must run it and send its
    # token, and nothing else.
    plugin = tmp_path / "get-token"
    plugin.write_text(
        "#!/bin/sh\n"
        'echo "$@" > "$(dirname "$0")/called-with"\n'
        "cat <<'EOF'\n"
        '{"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",'
        ' "status": {"token": "exec-token-42"}}\n'
        "EOF\n"
    )
    plugin.chmod(0o755)
    config = exec_kubeconfig(
        tmp_path,
        server=kube_api.url,
        plugin=plugin,
        args=["eks", "get-token", "--cluster-name", "prod"],
    )
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_e1", ["GPU-0"])))
    served_before = len(list(kube_api.emulator))
    loaded, _ = kube_config(kubeconfig=config, environ={})
    async with KubeClient(loaded) as client:
        objects = AllocationObjects(client=client, namespace=NS, node_name=NODE)
        assert [s["allocationId"] for s in await objects.desired()] == ["alloc_e1"]
        # ... and watches with it: a new allocation arrives through the watch.
        woken = asyncio.Event()
        task = asyncio.create_task(objects.follow(wake=woken.set))
        try:
            await kube_api.create(agents.device_allocation(allocation_spec("alloc_e2", ["GPU-1"])))
            async with asyncio.timeout(3):
                while objects.events < 1:
                    woken.clear()
                    await woken.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert [s["allocationId"] for s in await objects.desired()] == ["alloc_e1", "alloc_e2"]
    assert (tmp_path / "called-with").read_text().split() == [
        "eks",
        "get-token",
        "--cluster-name",
        "prod",
    ]
    # The test's own create aside (it speaks to the stand-in with its own client), the agent
    # only read: every read carries the plugin's token, the watch included.
    requests = [r for r in list(kube_api.emulator)[served_before:] if r.method != kmock.method.POST]
    assert any(request.params.get("watch") in ("true", "1") for request in requests), requests
    seen = [
        {k.lower(): v for k, v in request.headers.items()}.get("authorization")
        for request in requests
    ]
    assert seen
    assert all(header == "Bearer exec-token-42" for header in seen), seen


async def test_a_credential_plugin_that_hangs_is_a_timeout_not_a_hang(
    kube_api: KubeApi, tmp_path: Path
):
    plugin = tmp_path / "get-token"
    plugin.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 30\n")
    plugin.chmod(0o755)
    config = exec_kubeconfig(tmp_path, server=kube_api.url, plugin=plugin)
    loaded, _ = kube_config(kubeconfig=config, environ={})
    try:
        async with asyncio.timeout(5), KubeClient(loaded, timeout_s=0.5) as client:
            with pytest.raises(KubeError) as failed:
                await client.list(DEVICE_ALLOCATIONS, namespace=NS)
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    assert (failed.value.status, failed.value.reason) == (0, "Timeout")


async def test_a_watch_that_goes_silent_ends_so_that_the_caller_resumes():
    # A server that accepts the connection and never answers: what a network path that died
    # without a reset looks like from the node.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        config, _ = kube_config(api_server=f"http://127.0.0.1:{silent.getsockname()[1]}")
        started_at = asyncio.get_running_loop().time()
        async with asyncio.timeout(5), KubeClient(config, timeout_s=0.3) as client:
            events = [e async for e in client.watch(DEVICE_ALLOCATIONS, timeout_s=1)]
    assert events == []
    assert asyncio.get_running_loop().time() - started_at >= 1.3


# --- DeviceAllocations -------------------------------------------------------------------------


async def test_an_unreachable_api_is_an_error_never_an_empty_list():
    unreachable, _ = kube_config(api_server=f"http://127.0.0.1:{closed_port()}", environ={})
    async with KubeClient(unreachable) as client:
        objects = AllocationObjects(client=client, namespace=NS, node_name=NODE)
        with pytest.raises(KubeError) as failed:
            await objects.desired()
    assert failed.value.status == 0
    assert failed.value.reason == "Unreachable"


async def test_the_watch_resumes_from_the_last_version_it_saw(
    kube_api: KubeApi, client: KubeClient
):
    objects = AllocationObjects(client=client, namespace=NS, node_name=NODE)
    woken = asyncio.Event()
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_w1", ["GPU-0"])))

    async def follow_until(count: int) -> None:
        task = asyncio.create_task(objects.follow(wake=woken.set))
        try:
            async with asyncio.timeout(2):
                while objects.events < count:
                    woken.clear()
                    await woken.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    assert [s["allocationId"] for s in await objects.desired()] == ["alloc_w1"]  # a list
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_w2", ["GPU-1"])))
    await follow_until(1)

    # While nobody watches: one created, one deleted, one for another node.
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_w3", ["GPU-2"])))
    await kube_api.delete(DEVICEALLOCATIONS, NS, "alloc-w1")
    other = allocation_spec("alloc_x", ["GPU-3"])
    await kube_api.create(agents.device_allocation(other, node="gpu-node-2"))
    # Resumed, not listed again: exactly the two changes of this node's objects arrive.
    await follow_until(3)
    assert objects.events == 3
    assert [s["allocationId"] for s in await objects.desired()] == ["alloc_w2", "alloc_w3"]


async def test_a_watch_too_old_to_resume_lists_again(kube_api: KubeApi, client: KubeClient):
    objects = AllocationObjects(client=client, namespace=NS, node_name=NODE)
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_c1", ["GPU-0"])))
    assert [s["allocationId"] for s in await objects.desired()] == ["alloc_c1"]
    # While nobody watches: a change, then the history is compacted (etcd does this every few
    # minutes), so the version the copy was listed at can no longer be resumed from.
    await kube_api.create(agents.device_allocation(allocation_spec("alloc_c2", ["GPU-1"])))
    await kube_api.delete(DEVICEALLOCATIONS, NS, "alloc-c1")
    kube_api.emulator.compact()
    woken = asyncio.Event()
    task = asyncio.create_task(objects.follow(wake=woken.set))
    try:
        async with asyncio.timeout(3):
            while [s["allocationId"] for s in await objects.desired()] != ["alloc_c2"]:
                woken.clear()
                await woken.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_watch_binds_at_once_not_at_the_next_pass(kube_api: KubeApi, kubelet_node: Node):
    config = agents.agent_config(kube=kube_api, node=kubelet_node, pass_seconds=30.0)
    async with started(config) as agent:
        await agent.plugin.rebuilt.wait()
        await kube_api.create(agents.device_allocation(allocation_spec("alloc_f1", ["GPU-4"])))
        await kube_api.wait_for(
            DEVICEALLOCATIONS, NS, "alloc-f1", agents.phase_is("Bound"), timeout=2.0
        )


async def test_a_report_without_an_object_is_dropped(client: KubeClient):
    objects = AllocationObjects(client=client, namespace=NS, node_name=NODE)
    await objects.report(allocation_id="alloc_gone", status={"phase": "Released"})


# --- GPUNode -----------------------------------------------------------------------------------


async def test_a_new_gpunode_copies_the_node_labels_when_it_may_read_the_node(
    kube_api: KubeApi, client: KubeClient
):
    kube_api.emulator.declare(NODES, kind="Node")
    await kube_api.create(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"zone": "a"}}}
    )
    await publisher(client).connect()
    assert kube_api.stored(GPUNODES, None, NODE)["metadata"]["labels"] == {"zone": "a"}


@pytest.mark.parametrize("forbidden", [False, True])
async def test_without_a_readable_node_the_gpunode_has_no_labels(
    kube_api: KubeApi, client: KubeClient, forbidden: bool, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="bettercompute.deviceplugin.publishing")
    # No Node resource here: the stand-in answers 404, as for a Node that is not there; or
    # 403, as for an agent without RBAC to get nodes.
    if forbidden:
        kube_api.emulator[f"get /api/v1/nodes/{NODE}"] << 403
    await publisher(client).connect()
    gpunode = kube_api.stored(GPUNODES, None, NODE)
    assert gpunode["metadata"].get("labels") in (None, {})
    said = f"cannot read Node {NODE}" if forbidden else f"no Node {NODE}"
    assert said in caplog.text


async def test_given_labels_are_merged_into_an_existing_gpunode(
    kube_api: KubeApi, client: KubeClient
):
    await kube_api.create(
        {
            "apiVersion": GPUNODES.api_version,
            "kind": "GPUNode",
            "metadata": {"name": NODE, "labels": {"team": "ml", "bcd.dev/pool": "old"}},
            "spec": {},
        }
    )
    await publisher(client, labels=parse_labels("bcd.dev/pool=h100")).connect()
    labels = kube_api.stored(GPUNODES, None, NODE)["metadata"]["labels"]
    assert labels == {"team": "ml", "bcd.dev/pool": "h100"}


def test_node_labels_parse_or_name_the_bad_entry():
    assert parse_labels(" a=1, b.io/c=2 ,") == {"a": "1", "b.io/c": "2"}
    with pytest.raises(ValueError, match="'oops' is not key=value"):
        parse_labels("a=1,oops")


async def test_heartbeats_a_deleted_gpunode_and_a_clean_stop(kube_api: KubeApi, client: KubeClient):
    moments = iter(range(1_790_000_000, 1_790_100_000, 30))
    node = publisher(client, heartbeat_s=0.02, clock=lambda: float(next(moments)))
    await node.connect()
    allocations = Allocations()
    allocations.set_inventory(inventory())
    task = asyncio.create_task(node.run(allocations=allocations))
    try:
        first = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
        since = agents.ready_condition(first)["lastTransitionTime"]
        beat = first["status"]["heartbeatTime"]
        # The heartbeat moves on; Ready's transition time does not.
        later = await agents.wait_gpunode(kube_api, lambda o: o["status"]["heartbeatTime"] != beat)
        assert agents.ready_condition(later)["lastTransitionTime"] == since
        # Deleted under the agent's feet: the next heartbeat creates it again.
        await kube_api.delete(GPUNODES, None, NODE)
        again = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
        assert again["status"]["gpus"] == 5
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await node.stopped()
    stopped = agents.ready_condition(kube_api.stored(GPUNODES, None, NODE))
    assert (stopped["status"], stopped["reason"]) == ("False", "AgentStopped")
    assert await client.patch(GPUNODES_RESOURCE, "nowhere", {}, status=True) is None
