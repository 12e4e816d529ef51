"""``better-compute-deviceplugin`` as a person and a DaemonSet run it: its help, its one-line
errors and exit codes, retrying an unreachable API server, and a whole run in a real process
(settings from the environment, a kubeconfig) against the API, kubelet and PodResources
stand-ins, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from typer.testing import CliRunner

from bettercompute.deviceplugin.agent import cli
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, MIG, NODE, SLOT, Node, allocation_spec
from tests.support.kubeobjects import DEVICEALLOCATIONS
from tests.support.kubeserver import KubeApi


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_help_teaches_what_it_does_and_where_settings_come_from():
    result = CliRunner().invoke(cli, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    for taught in ("GPUNode", "DeviceAllocation", "bcd.dev/gpu.mig", "--inventory-file"):
        assert taught in result.output
    for variable in ("NODE_NAME", "POD_NAMESPACE", "BCD_INVENTORY_FILE", "BCD_METRICS_PORT"):
        assert variable in result.output


def test_without_a_node_name_it_says_how_to_give_one():
    result = CliRunner().invoke(cli, [], env={"NODE_NAME": None})
    assert result.exit_code == 2
    assert result.stderr == "Error: no node name: give --node-name or set NODE_NAME\n"


def test_a_bad_xid_list_is_a_usage_error_naming_the_flag():
    result = CliRunner().invoke(cli, ["--node-name", NODE, "--skip-xids", "48,seventy-nine"])
    assert result.exit_code == 2
    assert "--skip-xids" in result.stderr
    assert "'seventy-nine' is not an XID number" in result.stderr


@dataclass
class Process:
    """The agent in a child process, its stderr read line by line as it comes."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            async with self._arrived:
                self.lines.append(raw.decode().rstrip("\n"))
                self._arrived.notify_all()

    async def wait_line(self, *parts: str, within: float = 10.0) -> str:
        def found() -> str | None:
            return next((line for line in self.lines if all(p in line for p in parts)), None)

        try:
            async with asyncio.timeout(within), self._arrived:
                await self._arrived.wait_for(lambda: found() is not None)
        except TimeoutError:
            raise AssertionError(f"no line with {parts}; stderr:\n" + self.output()) from None
        line = found()
        assert line is not None
        return line

    async def finished(self, *, within: float = 10.0) -> int:
        async with asyncio.timeout(within):
            code = await self.process.wait()
            if self._reader is not None:
                await self._reader
        return code

    def output(self) -> str:
        return "\n".join(self.lines)


@contextlib.asynccontextmanager
async def agent_process(*args: str, env: Mapping[str, str]) -> AsyncIterator[Process]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BCD_", "KUBE"))}
    clean.pop("NODE_NAME", None)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bettercompute.deviceplugin.agent",
        *args,
        env={**clean, "LOG_LEVEL": "INFO", **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    running = Process(process=child)
    running._reader = asyncio.create_task(running._read())
    try:
        yield running
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await running._reader


async def test_a_bad_inventory_file_is_one_line_and_exit_code_1(tmp_path: Path):
    inventory = tmp_path / "node.yaml"
    inventory.write_text("gpus:\n  - {uuid: GPU-0, index: 0, model: H100}\n")
    (tmp_path / "plugins").mkdir()
    async with agent_process(
        "--node-name", NODE, "--plugin-dir", str(tmp_path / "plugins"),
        env={"BCD_INVENTORY_FILE": str(inventory)},
    ) as agent:  # fmt: skip
        assert await agent.finished() == 1
    assert agent.lines == [
        f"Error: cannot read the GPU inventory: {inventory}: gpus[0].memoryMiB: Field required"
    ]


async def test_an_unreachable_api_server_is_retried_and_said_until_sigterm(
    kubelet_node: Node,
):
    config = agents.agent_config(kube=None, node=kubelet_node)
    server = f"http://127.0.0.1:{free_port()}"
    async with agent_process(*_flags(config), "--api-server", server, env={}) as agent:
        await agent.wait_line("cannot reach the Kubernetes API at", server, "retrying in")
        agent.process.send_signal(signal.SIGTERM)
        assert await agent.finished() == 0
    assert not [line for line in agent.lines if "Traceback" in line]


async def test_a_whole_run_from_the_environment_then_sigterm(kube_api: KubeApi, kubelet_node: Node):
    config = agents.agent_config(kube=kube_api, node=kubelet_node, api_server=None)
    port = free_port()
    env = {
        "NODE_NAME": NODE,
        "POD_NAMESPACE": config.namespace,
        "BCD_INVENTORY_FILE": str(config.inventory_file),
        "BCD_DEVICE_PLUGIN_DIR": str(config.plugin_dir),
        "BCD_POD_RESOURCES_SOCKET": str(config.pod_resources_socket),
        "BCD_CDI_DIR": str(config.cdi_dir),
        "BCD_ENV_DIR": str(config.env_dir),
        "BCD_NODE_KEY": str(config.node_key),
        "BCD_METRICS_HOST": "127.0.0.1",
        "BCD_METRICS_PORT": str(port),
        "BCD_NODE_LABELS": "bcd.dev/pool=h100",
        "BCD_NVIDIA_CDI_DIRS": ",".join(str(d) for d in config.nvidia_cdi_dirs),
        "BCD_SKIP_XIDS": "48, 79",
        "KUBECONFIG": str(kube_api.kubeconfig),
    }
    async with agent_process(env=env) as agent:
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT], within=10.0)
        gpunode = await agents.wait_gpunode(
            kube_api, lambda o: agents.ready_condition(o).get("status") == "True"
        )
        assert gpunode["metadata"]["labels"] == {"bcd.dev/pool": "h100"}
        await kube_api.create(agents.device_allocation(allocation_spec("alloc_p1", ["GPU-1"])))
        await kube_api.wait_for(
            DEVICEALLOCATIONS, config.namespace, "alloc-p1", agents.phase_is("Bound")
        )
        await kubelet_node.stream(GPU).wait_devices({"GPU-1": "Healthy"})
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).text == "ready\n"
        assert (Path(config.cdi_dir) / "bcd-alloc_p1.json").is_file()

        agent.process.send_signal(signal.SIGTERM)
        assert await agent.finished() == 0
    stopped = agents.ready_condition(
        await agents.wait_gpunode(
            kube_api, lambda o: agents.ready_condition(o)["status"] == "False"
        )
    )
    assert stopped["reason"] == "AgentStopped"
    assert not [line for line in agent.lines if "Traceback" in line], agent.output()


def _flags(config) -> list[str]:
    return [
        "--node-name", config.node_name,
        "--inventory-file", str(config.inventory_file),
        "--plugin-dir", str(config.plugin_dir),
        "--pod-resources-socket", str(config.pod_resources_socket),
        "--cdi-dir", str(config.cdi_dir),
        "--env-dir", str(config.env_dir),
        "--node-key", str(config.node_key),
        "--metrics-host", "127.0.0.1",
        "--metrics-port", str(free_port()),
        "--nvidia-cdi-dirs", ",".join(str(d) for d in config.nvidia_cdi_dirs),
    ]  # fmt: skip
