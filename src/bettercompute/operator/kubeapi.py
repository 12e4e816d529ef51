"""A small async client for the few Kubernetes API calls the operator makes outside kopf.

Why our own: kopf patches the object a handler is running for, but the operator also writes
where no handler runs: a Reservation's ``status`` when the stored reservation changes (the
outbox and change notifications, not a watch event), ``DeviceAllocation`` objects, Events and
TokenReviews. It uses the credentials kopf logged in with (``kopf.ConnectionInfo``), so there
is one identity and one configuration.

What it must never do: retry on its own or let ``aiohttp`` errors escape. Every failure is a
``KubeApiError`` with the HTTP status (0 when the server could not be reached); callers decide
whether to retry.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import kopf


class KubeApiError(Exception):
    """An API call failed; ``status`` is the HTTP status, 0 when nothing answered."""

    def __init__(self, *, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Ref:
    """A resource type: ``Ref("bcd.dev", "v1alpha1", "reservations", namespaced=True)``."""

    group: str
    version: str
    plural: str
    namespaced: bool
    kind: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, *, namespace: str | None = None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name, safe='')}"
        return base


EVENTS = Ref("", "v1", "events", namespaced=True, kind="Event")
TOKEN_REVIEWS = Ref("authentication.k8s.io", "v1", "tokenreviews", namespaced=False)


class KubeApi:
    """One aiohttp session to the API server kopf logged in to."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout_s: float = 10.0):
        self.server = info.server.rstrip("/")
        headers = {"Accept": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = None
        if info.username and info.password:
            auth = aiohttp.BasicAuth(info.username, info.password)
        self._session = aiohttp.ClientSession(
            headers=headers,
            auth=auth,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info), limit=64),
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> Any:
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body)
        try:
            async with self._session.request(
                method, url, data=data, headers={"Content-Type": content_type}
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise _error(response.status, text)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise KubeApiError(status=0, reason="Unreachable", message=str(e) or repr(e)) from e

    async def get(
        self, ref: Ref, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        try:
            found: dict[str, Any] = await self._call(
                "GET", ref.path(namespace=namespace, name=name)
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise
        return found

    async def list(
        self, ref: Ref, *, namespace: str | None = None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        answer = await self._call("GET", ref.path(namespace=namespace), query=query)
        return list(answer.get("items") or [])

    async def create(
        self, ref: Ref, body: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        created: dict[str, Any] = await self._call(
            "POST", ref.path(namespace=namespace), body=dict(body)
        )
        return created

    async def patch(
        self,
        ref: Ref,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        status: bool = False,
    ) -> dict[str, Any] | None:
        """A JSON merge patch of the object (or of its ``status`` subresource); ``None`` when
        the object is gone."""
        path = ref.path(namespace=namespace, name=name) + ("/status" if status else "")
        try:
            patched: dict[str, Any] = await self._call(
                "PATCH", path, body=dict(body), content_type="application/merge-patch+json"
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise
        return patched

    async def delete(self, ref: Ref, name: str, *, namespace: str | None = None) -> bool:
        """``False`` when there was nothing to delete."""
        try:
            await self._call("DELETE", ref.path(namespace=namespace, name=name))
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def post_event(
        self,
        *,
        involved: Mapping[str, Any],
        type_: str,
        reason: str,
        message: str,
        namespace: str,
    ) -> None:
        """A core/v1 Event about ``involved`` (its apiVersion, kind and metadata)."""
        meta = involved.get("metadata") or {}
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.create(
            EVENTS,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": "bcd-", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": involved.get("apiVersion"),
                    "kind": involved.get("kind"),
                    "name": meta.get("name"),
                    "namespace": meta.get("namespace"),
                    "uid": meta.get("uid"),
                },
                "type": type_,
                "reason": reason,
                "message": message[:1024],
                "source": {"component": "better-compute-operator"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "reportingComponent": "bcd.dev/operator",
            },
            namespace=namespace,
        )

    async def token_review(self, token: str) -> dict[str, Any]:
        """The API server's ``TokenReview`` status for a bearer token."""
        answer = await self._call(
            "POST",
            TOKEN_REVIEWS.path(),
            body={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status: dict[str, Any] = (answer or {}).get("status") or {}
        return status


def _error(status: int, text: str) -> KubeApiError:
    try:
        body = json.loads(text)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return KubeApiError(
        status=status,
        reason=str(body.get("reason") or "Error"),
        message=str(body.get("message") or text[:500]),
    )


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        return False
    context = ssl.create_default_context()
    if info.ca_path:
        context.load_verify_locations(cafile=os.fsdecode(info.ca_path))
    elif info.ca_data:
        context.load_verify_locations(cadata=_pem(info.ca_data))
    cert = _file(info.certificate_path, info.certificate_data)
    key = _file(info.private_key_path, info.private_key_data)
    if cert is not None:
        context.load_cert_chain(certfile=cert, keyfile=key)
    return context


def _pem(data: str | bytes) -> str:
    """kubeconfig carries certificates base64-encoded; a PEM text is taken as is."""
    raw = data.encode() if isinstance(data, str) else data
    if raw.lstrip().startswith(b"-----BEGIN"):
        return raw.decode()
    return base64.b64decode(raw).decode()


def _file(path: str | bytes | os.PathLike[Any] | None, data: str | bytes | None) -> str | None:
    """A path for ``load_cert_chain``, which reads files only: inline data goes to a 0600
    temporary file that lives as long as the process."""
    if path:
        return os.fsdecode(path)
    if not data:
        return None
    handle = tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False)  # noqa: SIM115
    with handle:
        os.chmod(handle.name, 0o600)
        handle.write(_pem(data))
    return handle.name
