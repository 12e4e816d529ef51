"""The Kubernetes API stand-in served over real HTTP, as pytest fixtures.

Why it exists: operator and node-agent tests need a Kubernetes API to talk to; this plugin
serves ``tests/support/kube.py``'s ``ApiServerStandIn`` on 127.0.0.1 with kmock, declares the
core resources and the project's CRDs (``crds/*.yaml`` when that directory exists), writes a
kubeconfig that points at it, and gives tests small HTTP conveniences (``KubeApi``).
``operator_running`` runs a kopf operator in the test's event loop and stops it cleanly.

Who calls it: pytest, as a plugin listed in ``tests/conftest.py``'s ``pytest_plugins``; tests
use the ``kube_api`` fixture. What it must never do: reach beyond loopback, or share one
server between tests (each test gets a fresh, empty API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import kmock
import kopf
import pytest
import yaml

from tests.support.kube import ApiServerStandIn, Ref

CRDS_DIR = Path(__file__).resolve().parents[2] / "crds"
TOKEN = "stand-in-token"  # the kubeconfig's bearer token; the stand-in accepts any


class ApiStatusError(Exception):
    """A non-2xx answer from the stand-in: ``status`` and the ``Status`` ``body``."""

    def __init__(self, *, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {json.dumps(body)[:500]}")
        self.status = status
        self.body = body


class KubeApi:
    """One running stand-in: its URL, the emulator, a kubeconfig, and HTTP conveniences."""

    def __init__(
        self, *, url: str, emulator: ApiServerStandIn, kubeconfig: Path, client: httpx.AsyncClient
    ) -> None:
        self.url = url
        self.emulator = emulator
        self.kubeconfig = kubeconfig
        self._client = client

    @property
    def tokens(self) -> dict[str, dict[str, Any]]:
        """TokenReview's table: ``tokens[token] = {"username", "uid", "groups"}``."""
        return self.emulator.tokens

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        content = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type}
        response = await self._client.request(
            method, path, content=content, headers=headers, params=params
        )
        payload = response.json() if response.content else None
        if response.is_error:
            raise ApiStatusError(status=response.status_code, body=payload)
        return payload

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to the resource its ``apiVersion``/``kind`` name; the stored object."""
        ref = self.emulator.ref_for(api_version=obj["apiVersion"], kind=obj["kind"])
        namespace = obj.get("metadata", {}).get("namespace") if ref.namespaced else None
        created: dict[str, Any] = await self._call("POST", ref.path(namespace=namespace), body=obj)
        return created

    async def get(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object over HTTP, or None on 404."""
        try:
            found: dict[str, Any] = await self._call("GET", _path(ref, namespace, name))
        except ApiStatusError as e:
            if e.status == 404:
                return None
            raise
        return found

    async def list(
        self, ref: Ref, namespace: str | None = None, *, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        path = ref.path(namespace=namespace if ref.namespaced else None)
        params = {"labelSelector": label_selector} if label_selector else None
        listed = await self._call("GET", path, params=params)
        items: list[dict[str, Any]] = listed["items"]
        return items

    async def patch(
        self,
        ref: Ref,
        namespace: str | None,
        name: str,
        body: Mapping[str, Any],
        *,
        status: bool = False,
    ) -> dict[str, Any]:
        """Merge-patch the object (or its ``/status`` with ``status=True``)."""
        path = _path(ref, namespace, name, subresource="status" if status else "")
        patched: dict[str, Any] = await self._call(
            "PATCH", path, body=body, content_type="application/merge-patch+json"
        )
        return patched

    async def delete(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any]:
        """DELETE: the object as deleted, or as marked for deletion when it has finalizers."""
        deleted: dict[str, Any] = await self._call("DELETE", _path(ref, namespace, name))
        return deleted

    def stored(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object without HTTP (a copy), or None when absent."""
        return self.emulator.stored(ref, namespace, name)

    async def wait_for(
        self,
        ref: Ref,
        namespace: str | None,
        name: str,
        predicate: Callable[[dict[str, Any] | None], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - the failure must show the last object seen
    ) -> dict[str, Any] | None:
        """Wait until ``predicate(stored object or None)`` holds; else fail showing the object.

        It re-checks after every write the stand-in commits, so it never sleeps.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            seen = self.emulator.revision
            obj = self.stored(ref, namespace, name)
            if predicate(obj):
                return obj
            try:
                async with asyncio.timeout_at(deadline):
                    await self.emulator.written(since=seen)
            except TimeoutError:
                obj = self.stored(ref, namespace, name)
                if predicate(obj):
                    return obj
                shown = json.dumps(obj, indent=2, sort_keys=True)
                where = f"{ref.plural} {namespace}/{name}" if namespace else f"{ref.plural} {name}"
                pytest.fail(f"{where}: condition not met within {timeout}s; last seen:\n{shown}")


def _path(ref: Ref, namespace: str | None, name: str, *, subresource: str = "") -> str:
    scope = namespace if ref.namespaced else None
    return ref.path(namespace=scope, name=name, subresource=subresource)


def write_kubeconfig(*, path: Path, url: str, token: str = TOKEN) -> Path:
    """A kubeconfig with one context pointing at ``url`` (for ``kopf.login_with_kubeconfig``)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "stand-in", "user": {"token": token}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in"}}],
        "current-context": "stand-in",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
async def kube_api(tmp_path: Path) -> AsyncIterator[KubeApi]:
    """A fresh stand-in on 127.0.0.1 with core resources and the project's CRDs declared."""
    emulator = ApiServerStandIn()
    if CRDS_DIR.is_dir():
        emulator.declare_crds(CRDS_DIR)
    async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(path=tmp_path / "kubeconfig", url=url)
        # No keep-alive: an idle pooled connection would be a server task kopf's shutdown
        # waits 5 s for ("hung tasks"), when an operator runs in the same loop.
        # Plain HTTP on loopback: verify=False only skips loading a CA bundle (60 ms a client).
        limits = httpx.Limits(max_keepalive_connections=0)
        client = httpx.AsyncClient(base_url=url, limits=limits, timeout=5.0, verify=False)
        async with client:
            yield KubeApi(url=url, emulator=emulator, kubeconfig=kubeconfig, client=client)
        # A 500 is a bug in the stand-in itself; intended answers are KubernetesErrors.
        crashes = [e for e in emulator.errors if not isinstance(e, kmock.KubernetesError)]
        if crashes:
            pytest.fail(f"the API stand-in crashed while serving: {crashes!r}")


@contextlib.asynccontextmanager
async def operator_running(
    *,
    registry: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    memo: object | None = None,
    startup_timeout: float = 5.0,
    stop_timeout: float = 10.0,
) -> AsyncIterator[None]:
    """Run a cluster-wide kopf operator in this event loop for the duration of the block.

    The registry needs an ``@kopf.on.login`` handler (e.g. ``kopf.login_with_kubeconfig``
    with ``KUBECONFIG`` set to ``kube_api.kubeconfig``). Operator failures are re-raised on
    exit; the SIGINT/SIGTERM handlers kopf installs on the loop are removed again.
    """
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=settings,
            memo=memo,
            clusterwide=True,
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    try:
        ready_wait = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait(
            {task, ready_wait}, timeout=startup_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        ready_wait.cancel()
        await asyncio.wait({ready_wait})
        if task in done:
            task.result()  # raises the operator's failure
            pytest.fail("the kopf operator exited during startup")
        if not done:
            pytest.fail(f"the kopf operator was not ready within {startup_timeout}s")
        yield
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout=stop_timeout)
        finally:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
