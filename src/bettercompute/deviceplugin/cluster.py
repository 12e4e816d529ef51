"""The node agent's Kubernetes API client: credentials, a handful of calls, and one watch.

Why our own: the node needs six calls (get, list, create, merge-patch, a ``/status``
merge-patch, a watch) on two resources. The ``kubernetes`` package would bring a thread pool
and a code generator's worth of models for that, and kopf is an operator framework; a small
aiohttp client keeps the DaemonSet's image lean and its behaviour readable.

Credentials (``credentials``), in this order:

1. an explicit ``--api-server`` (with ``--api-token``): tests, or a proxy;
2. a kubeconfig named by ``--kubeconfig`` or ``$KUBECONFIG``: a token, a token file or a client
   certificate, and the cluster's CA. Exec and auth-provider plugins are not run: the error
   says so and what to use instead;
3. the pod's service account (``/var/run/secrets/kubernetes.io/serviceaccount``), at
   ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` (else
   ``https://kubernetes.default.svc``). The token file is re-read for every request and watch,
   because the kubelet rotates bound service-account tokens;
4. ``~/.kube/config`` when it exists.

What it must never do: retry on its own, log a token, or let an ``aiohttp`` error escape.
Every failed call is a ``ClusterError`` with the HTTP status (0 when nothing answered); the
callers decide whether and when to retry.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_SERVER = "https://kubernetes.default.svc"
TIMEOUT_SECONDS = 10.0


class ClusterError(Exception):
    """An API call failed; ``status`` is the HTTP status, 0 when the server did not answer."""

    def __init__(self, *, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class CredentialsError(Exception):
    """No usable way to reach the API server; the message says what is missing or wrong."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are."""

    server: str
    #: Where they came from, for the startup log line (never the secret itself).
    source: str
    token: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    ca_data: str | None = None  # PEM
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    client_cert_data: str | None = None  # PEM
    client_key_data: str | None = None  # PEM
    insecure: bool = False


def credentials(
    *,
    api_server: str | None = None,
    api_token: str | None = None,
    kubeconfig: Path | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] | None = None,
) -> Credentials:
    """The first of: explicit server, kubeconfig, service account, ``~/.kube/config``."""
    env = os.environ if environ is None else environ
    if api_server:
        return Credentials(server=api_server.rstrip("/"), source="--api-server", token=api_token)
    named = kubeconfig or (Path(env["KUBECONFIG"]) if env.get("KUBECONFIG") else None)
    if named is not None:
        return read_kubeconfig(named)
    token_file = service_account_dir / "token"
    if token_file.is_file():
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        server = IN_CLUSTER_SERVER
        if host:
            shown = f"[{host}]" if ":" in host else host
            server = f"https://{shown}:{port or 443}"
        ca_file = service_account_dir / "ca.crt"
        return Credentials(
            server=server,
            source=f"the service account in {service_account_dir}",
            token_file=token_file,
            ca_file=ca_file if ca_file.is_file() else None,
        )
    home = Path(env.get("HOME") or "~").expanduser() / ".kube" / "config"
    if home.is_file():
        return read_kubeconfig(home)
    raise CredentialsError(
        "no Kubernetes API server: run in a pod with a service account, set KUBECONFIG or "
        "--kubeconfig, or give --api-server"
    )


def read_kubeconfig(path: Path) -> Credentials:
    """The current context of a kubeconfig file, reduced to what ``Credentials`` holds."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CredentialsError(f"kubeconfig {path}: cannot read: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise CredentialsError(f"kubeconfig {path}: not valid YAML: {e}") from e
    if not isinstance(document, dict):
        raise CredentialsError(f"kubeconfig {path}: must be a mapping")

    def named(section: str, name: Any) -> dict[str, Any]:
        for entry in document.get(section) or ():
            if isinstance(entry, dict) and entry.get("name") == name:
                key = section.rstrip("s")  # clusters -> cluster, users -> user, ...
                found = entry.get(key)
                return found if isinstance(found, dict) else {}
        raise CredentialsError(f"kubeconfig {path}: {section}: no entry named {name!r}")

    current = document.get("current-context")
    if not current:
        raise CredentialsError(f"kubeconfig {path}: current-context is not set")
    context = named("contexts", current)
    cluster = named("clusters", context.get("cluster"))
    user = named("users", context.get("user")) if context.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise CredentialsError(f"kubeconfig {path}: cluster {context.get('cluster')!r}: no server")
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise CredentialsError(
                f"kubeconfig {path}: user {context.get('user')!r} uses an {plugin} plugin, "
                "which the device plugin does not run; use a token or a client certificate"
            )
    base = path.parent

    def file(value: Any) -> Path | None:
        return None if not value else (base / str(value))

    def data(field: str, value: Any) -> str | None:
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as e:
            raise CredentialsError(f"kubeconfig {path}: {field}: not base64 PEM: {e}") from e

    return Credentials(
        server=server.rstrip("/"),
        source=f"kubeconfig {path} (context {current!r})",
        token=user.get("token") or None,
        token_file=file(user.get("tokenFile")),
        ca_file=file(cluster.get("certificate-authority")),
        ca_data=data("certificate-authority-data", cluster.get("certificate-authority-data")),
        client_cert_file=file(user.get("client-certificate")),
        client_key_file=file(user.get("client-key")),
        client_cert_data=data("client-certificate-data", user.get("client-certificate-data")),
        client_key_data=data("client-key-data", user.get("client-key-data")),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


class ClusterClient:
    """One aiohttp session to the API server. Use it as ``async with ClusterClient(...)``."""

    def __init__(self, *, credentials: Credentials, timeout_s: float = TIMEOUT_SECONDS) -> None:
        self.credentials = credentials
        self.server = credentials.server
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    # --- calls -----------------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or ``None`` when it does not exist."""
        try:
            found: dict[str, Any] = await self._call("GET", path)
        except ClusterError as e:
            if e.status == 404:
                return None
            raise
        return found

    async def list(
        self, path: str, *, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """Every item at ``path`` and the list's ``resourceVersion`` (to watch from)."""
        query = {"labelSelector": label_selector} if label_selector else None
        answer = await self._call("GET", path, query=query)
        if not isinstance(answer, dict) or not isinstance(answer.get("items"), list):
            raise ClusterError(status=0, reason="BadAnswer", message=f"{path}: not a list")
        version = str((answer.get("metadata") or {}).get("resourceVersion") or "")
        return [item for item in answer["items"] if isinstance(item, dict)], version

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await self._call("POST", path, body=body)
        return created

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (``null`` removes a field; lists are replaced whole)."""
        patched: dict[str, Any] = await self._call(
            "PATCH", path, body=body, content_type="application/merge-patch+json"
        )
        return patched

    async def watch(
        self,
        path: str,
        *,
        label_selector: str | None,
        resource_version: str,
        timeout_s: int,
    ) -> AsyncIterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``) after ``resource_version``, until the
        server ends the stream (after about ``timeout_s``). An ``ERROR`` event is raised as a
        ``ClusterError`` with its code (410: the version is too old, list again)."""
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
        }
        if label_selector:
            query["labelSelector"] = label_selector
        # No total limit: the stream lives for timeout_s. A read timeout a little longer than
        # that notices a connection that died without a FIN.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeout_s, sock_read=timeout_s + 30
        )
        try:
            async with self._open().get(
                self.server + path, params=query, headers=self._headers(), timeout=timeout
            ) as response:
                if response.status >= 400:
                    raise _error(response.status, await response.text())
                pending = b""
                async for chunk in response.content.iter_any():
                    pending += chunk
                    while b"\n" in pending:
                        line, _, pending = pending.partition(b"\n")
                        if line.strip():
                            yield _event(json.loads(line))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            raise _unreachable(self.server, e) from e

    # --- plumbing --------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = self._headers()
        headers["Content-Type"] = content_type
        try:
            async with self._open().request(
                method, self.server + path, params=query, data=data, headers=headers
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise _error(response.status, text)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            raise _unreachable(self.server, e) from e

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self.credentials.token
        if self.credentials.token_file is not None:
            try:
                token = self.credentials.token_file.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ClusterError(
                    status=0,
                    reason="NoToken",
                    message=f"cannot read {self.credentials.token_file}: {e.strerror or e}",
                ) from e
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(ssl=self._ssl()),
            )
        return self._session

    def _ssl(self) -> ssl.SSLContext | bool:
        c = self.credentials
        if not c.server.startswith("https"):
            return True  # plain HTTP: nothing to verify
        if c.insecure:
            return False
        context = ssl.create_default_context()
        if c.ca_file is not None:
            context.load_verify_locations(cafile=str(c.ca_file))
        if c.ca_data is not None:
            context.load_verify_locations(cadata=c.ca_data)
        cert, key = c.client_cert_file, c.client_key_file
        # load_cert_chain reads files only: inline data goes to a private scratch folder.
        if c.client_cert_data is not None:
            cert = self._scratch_file("client.crt", c.client_cert_data)
        if c.client_key_data is not None:
            key = self._scratch_file("client.key", c.client_key_data)
        if cert is not None:
            context.load_cert_chain(certfile=str(cert), keyfile=None if key is None else str(key))
        return context

    def _scratch_file(self, name: str, text: str) -> Path:
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="bcd-kube-")
        path = Path(self._scratch.name) / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path


def _event(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("object"), dict):
        raise ClusterError(status=0, reason="BadAnswer", message=f"not a watch event: {raw!r}")
    if raw.get("type") == "ERROR":
        status = raw["object"]
        raise ClusterError(
            status=int(status.get("code") or 500),
            reason=str(status.get("reason") or "Error"),
            message=str(status.get("message") or "the watch ended with an error"),
        )
    return raw


def _error(status: int, text: str) -> ClusterError:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    return ClusterError(
        status=status,
        reason=str(body.get("reason") or "Error"),
        message=str(body.get("message") or text[:300] or "no message"),
    )


def _unreachable(server: str, error: BaseException) -> ClusterError:
    if isinstance(error, ValueError):
        return ClusterError(status=0, reason="BadAnswer", message=f"{server}: not JSON: {error}")
    return ClusterError(
        status=0, reason="Unreachable", message=f"{server}: {error or type(error).__name__}"
    )
