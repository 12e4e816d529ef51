"""One Kubernetes API client for the operator and the node agent, on lightkube.

Why lightkube: it is async, typed, maintained, and already does what a cluster's credentials
need: kubeconfig files with exec credential plugins (EKS, GKE, AKS), client certificates, token
files re-read for each request (the kubelet rotates bound service-account tokens), in-cluster
service accounts, and watches that carry a ``resourceVersion``. This module only narrows it to
the calls our programs make, with plain dicts in and out and one error type.

Credentials for the node agent (``kube_config``), in this order:

1. an explicit ``--api-server`` (with ``--api-token``): tests, or a proxy;
2. a kubeconfig named by ``--kubeconfig`` or ``$KUBECONFIG`` (its current context, exec and
   auth-provider plugins included);
3. the pod's service account (``/var/run/secrets/kubernetes.io/serviceaccount``), at
   ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` (else
   ``https://kubernetes.default.svc``);
4. ``~/.kube/config`` when it exists.

The operator builds its configuration from the credentials kopf logged in with, so there is one
identity per program (in a pod, its token read from the service account's file, as here).

What it must never do: retry on its own (a watch's reconnect from its last version aside), log
a token, wait without bound, or let a lightkube or httpx error escape. Every failed call is a
``KubeError`` with the HTTP status (0 when nothing answered in time); the callers decide whether
and when to retry.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import datetime as dt
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import yaml
from lightkube import AsyncClient, ConfigError, operators
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError, NotReadyError
from lightkube.types import OnErrorAction, OnErrorResult, PatchType

from bettercompute.kube import resources

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_SERVER = "https://kubernetes.default.svc"
TIMEOUT_SECONDS = 10.0
#: How long the server keeps one watch open before it ends it (the client then resumes).
WATCH_TIMEOUT_SECONDS = 290

T = TypeVar("T")


class KubeError(Exception):
    """A failed API call: the HTTP ``status`` (0: no answer, or none in time)."""

    def __init__(self, *, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status = status
        self.reason = reason
        self.message = message


class CredentialsError(Exception):
    """No usable credentials; the message says what was tried and what to do."""


def kube_config(
    *,
    api_server: str | None = None,
    api_token: str | None = None,
    kubeconfig: Path | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] | None = None,
) -> tuple[KubeConfig, str]:
    """(configuration, where it came from): explicit server, kubeconfig, service account,
    ``~/.kube/config``, the first that applies."""
    env = os.environ if environ is None else environ
    if api_server:
        user = User(token=api_token) if api_token else User()
        return KubeConfig.from_one(cluster=Cluster(server=api_server.rstrip("/")), user=user), (
            "--api-server"
        )
    named = kubeconfig or (Path(env["KUBECONFIG"]) if env.get("KUBECONFIG") else None)
    if named is not None:
        return read_kubeconfig(named)
    token_file = service_account_dir / "token"
    if token_file.is_file():
        ca_file = service_account_dir / "ca.crt"
        cluster = Cluster(
            server=in_cluster_server(env),
            certificate_auth=str(ca_file) if ca_file.is_file() else None,
        )
        config = KubeConfig.from_one(cluster=cluster, user=User(token_file=str(token_file)))
        return config, f"the service account in {service_account_dir}"
    home = Path(env.get("HOME") or "~").expanduser() / ".kube" / "config"
    if home.is_file():
        return read_kubeconfig(home)
    raise CredentialsError(
        "no Kubernetes API server: run in a pod with a service account, set KUBECONFIG or "
        "--kubeconfig, or give --api-server"
    )


def in_cluster_server(environ: Mapping[str, str]) -> str:
    """The API server as a pod sees it: ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``
    (what client-go uses), else the cluster DNS name."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host:
        return IN_CLUSTER_SERVER
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}:{port or 443}"


def read_kubeconfig(path: Path) -> tuple[KubeConfig, str]:
    """A kubeconfig file's current context, checked now so that a bad file is one clear line
    at start, not an error at the first call."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        config = KubeConfig.from_dict(document, fname=path)
        current = config.get()
    except OSError as e:
        raise CredentialsError(f"kubeconfig {path}: cannot read: {e.strerror or e}") from e
    except (ConfigError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError) as e:
        # lightkube (and the YAML and msgspec beneath it) say what is wrong in their words;
        # KeyError: a section missing, or a context naming a cluster the file does not have.
        said = f"no {e.args[0]!r} entry" if isinstance(e, KeyError) and e.args else _said(e)
        raise CredentialsError(f"kubeconfig {path}: {said}") from e
    clusters = {c.get("name"): c.get("cluster") or {} for c in document.get("clusters") or ()}
    if current is None or not clusters.get(current.context.cluster, {}).get("server"):
        # lightkube would quietly use http://localhost:8080.
        raise CredentialsError(f"kubeconfig {path}: the current context's cluster has no server")
    return config, f"kubeconfig {path} (context {current.context_name!r})"


def server_of(config: KubeConfig) -> str:
    """The API server a configuration's current context names."""
    current = config.get()
    return "" if current is None else str(current.cluster.server)


def from_kopf(info: Any, *, token_file: Path | None = None) -> KubeConfig:
    """The configuration for the credentials kopf logged in with (a ``kopf.ConnectionInfo``;
    typed ``Any`` so this package never imports kopf).

    ``token_file``: the file kopf read its token from (a pod's service account). The client
    then reads the token from it, and again when the server refuses it: the kubelet rotates
    that token, and a copy taken at start stops working when it expires."""
    cluster = Cluster(
        server=str(info.server).rstrip("/"),
        certificate_auth=info.ca_path,
        certificate_auth_data=_b64(info.ca_data),
        insecure=bool(info.insecure),
    )
    user = User(
        token=None if token_file else info.token or None,
        token_file=str(token_file) if token_file else None,
        username=info.username or None,
        password=info.password or None,
        client_cert=info.certificate_path,
        client_cert_data=_b64(info.certificate_data),
        client_key=info.private_key_path,
        client_key_data=_b64(info.private_key_data),
    )
    return KubeConfig.from_one(cluster=cluster, user=user, namespace=info.default_namespace)


class KubeClient:
    """One lightkube client; ``await close()`` when done (or ``async with``)."""

    def __init__(self, config: KubeConfig, *, timeout_s: float = TIMEOUT_SECONDS) -> None:
        # trust_env=False: a proxy or CA bundle from the environment must not change whom
        # the agent trusts; the kubeconfig says it.
        try:
            self._client = AsyncClient(config, timeout=httpx2.Timeout(timeout_s), trust_env=False)
        except (OSError, ConfigError, ValueError) as e:
            # lightkube loads the CA and the client certificate here (ssl.SSLError is an
            # OSError): a missing file or bad data is the configuration's fault, said once.
            raise CredentialsError(
                f"cannot load its TLS certificate authority or client certificate: {_said(e)}"
            ) from e
        self._timeout_s = timeout_s

    @property
    def server(self) -> str:
        """The API server's URL, for messages."""
        return str(self._client.config.cluster.server)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.close()

    async def _within(self, call: Awaitable[T]) -> T:
        """``call``, given ``timeout_s`` in all: httpx bounds each connect, read and write, but
        not a credential plugin that hangs (lightkube runs it before the request) nor the whole
        call."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call
        except TimeoutError as e:
            raise KubeError(
                status=0,
                reason="Timeout",
                message=f"no answer from {self.server} within {self._timeout_s:g} s",
            ) from e

    async def get(
        self, resource: Any, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        try:
            return _plain(await self._within(self._client.get(resource, name, namespace=namespace)))
        except Exception as e:
            if _status(e) == 404:
                return None
            raise _error(e) from e

    async def list(
        self,
        resource: Any,
        *,
        namespace: str | None = None,
        labels: Mapping[str, str | operators.Operator[Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Every object (with ``labels``, those that carry them), never a partial list."""
        items, _ = await self.list_from(resource, namespace=namespace, labels=labels)
        return items

    async def list_from(
        self,
        resource: Any,
        *,
        namespace: str | None = None,
        labels: Mapping[str, str | operators.Operator[Any]] | None = None,
    ) -> tuple[builtins.list[dict[str, Any]], str | None]:
        """(items, the list's ``resourceVersion``), to watch from: every object, never a
        partial list."""
        try:
            listed = self._client.list(
                resource, namespace=namespace, labels=dict(labels) if labels else None
            )

            async def every() -> builtins.list[dict[str, Any]]:
                return [_plain(obj) async for obj in listed]

            items = await self._within(every())
        except Exception as e:
            raise _error(e) from e
        try:
            version: str | None = listed.resourceVersion
        except NotReadyError:
            version = None  # a server that gave no version: a watch starts from now
        return items, version

    async def create(
        self, resource: Any, body: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        try:
            obj = resource.from_dict(dict(body))
            created = await self._within(
                self._client.create(obj, namespace=namespace)  # type: ignore[call-overload]
                if namespace is not None
                else self._client.create(obj)
            )
            return _plain(created)
        except Exception as e:
            raise _error(e) from e

    async def patch(
        self,
        resource: Any,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        status: bool = False,
    ) -> dict[str, Any] | None:
        """A JSON merge patch of the object (or of its ``status``); ``None`` when it is gone."""
        target = resource.Status if status else resource
        try:
            patched = await self._within(
                self._client.patch(
                    target, name, dict(body), namespace=namespace, patch_type=PatchType.MERGE
                )
            )
        except Exception as e:
            if _status(e) == 404:
                return None
            raise _error(e) from e
        return _plain(patched)

    async def replace(
        self,
        resource: Any,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> dict[str, Any] | None:
        """PUT ``body`` in place of the object, or of one of its subresources when
        ``resource`` is a subresource class (a CSR's ``CSR_APPROVAL``, ``CSR_STATUS``);
        ``None`` when it is gone. A stale ``metadata.resourceVersion`` is 409, which the
        caller answers by reading the object again."""
        try:
            obj = resource.from_dict(dict(body))
            replaced = await self._within(self._client.replace(obj, name, namespace=namespace))
        except Exception as e:
            if _status(e) == 404:
                return None
            raise _error(e) from e
        return _plain(replaced)

    async def serves(self, group_version: str) -> bool:
        """Whether the API server serves ``group_version`` (``resource.k8s.io/v1``): its
        discovery document answers. lightkube has no discovery call, so this asks its HTTP
        client (configured with the server, credentials and CA) for ``/apis/<group_version>``."""
        http = self._client._client._client
        try:
            answer = await self._within(http.get(f"/apis/{group_version}"))
        except KubeError:
            raise
        except Exception as e:
            raise _error(e) from e
        if answer.status_code == 404:
            return False
        if answer.status_code >= 400:
            raise KubeError(
                status=answer.status_code,
                reason="Discovery",
                message=f"/apis/{group_version}: {answer.status_code} {answer.text[:200]}",
            )
        return True

    async def delete(self, resource: Any, name: str, *, namespace: str | None = None) -> bool:
        """``False`` when there was nothing to delete."""
        try:
            await self._within(self._client.delete(resource, name, namespace=namespace))
        except Exception as e:
            if _status(e) == 404:
                return False
            raise _error(e) from e
        return True

    async def watch(
        self,
        resource: Any,
        *,
        namespace: str | None = None,
        labels: Mapping[str, str | operators.Operator[Any]] | None = None,
        fields: Mapping[str, str] | None = None,
        resource_version: str | None = None,
        timeout_s: int = WATCH_TIMEOUT_SECONDS,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events from ``resource_version`` on, bookmarks included, until the
        connection fails: then ``KubeError`` (410 when the version is too old to resume).

        The server ends each watch after ``timeout_s`` and lightkube resumes it from the last
        version. When nothing at all arrives for ``timeout_s`` plus the call timeout (a server
        gone silent, a network path that died without a reset, a credential plugin that hangs)
        the iteration ends, so that the caller resumes from its last version on a new
        connection instead of waiting forever."""

        def give_up(_error: Exception, _count: int) -> OnErrorResult:
            return OnErrorResult(OnErrorAction.RAISE)

        events = aiter(
            self._client.watch(
                resource,
                namespace=namespace,
                labels=dict(labels) if labels else None,
                fields=dict(fields) if fields else None,
                resource_version=resource_version,
                on_error=give_up,
                server_timeout=timeout_s,
            )
        )
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout_s + self._timeout_s) as quiet:
                        kind, obj = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if quiet.expired():
                        return
                    raise
                yield kind, _plain(obj)
        except Exception as e:
            raise _error(e) from e
        finally:
            if isinstance(events, AsyncGenerator):  # lightkube's is: end its request now
                await events.aclose()

    async def post_event(
        self,
        *,
        involved: Mapping[str, Any],
        type_: str,
        reason: str,
        message: str,
        namespace: str,
        component: str = "operator",
    ) -> None:
        """A core/v1 Event about ``involved`` (its apiVersion, kind and metadata), reported
        by ``component`` (``operator``, ``device-plugin``)."""
        meta = involved.get("metadata") or {}
        about = {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        }
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.create(
            resources.EVENTS,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": "bcd-", "namespace": namespace},
                "involvedObject": {k: v for k, v in about.items() if v is not None},
                "type": type_,
                "reason": reason,
                "message": message[:1024],
                "source": {"component": f"better-compute-{component}"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "reportingComponent": f"bcd.dev/{component}",
            },
            namespace=namespace,
        )

    async def token_review(self, token: str) -> dict[str, Any]:
        """The API server's ``TokenReview`` status for a bearer token."""
        answer = await self.create(
            resources.TOKEN_REVIEWS,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status: dict[str, Any] = answer.get("status") or {}
        return status


def _plain(obj: Any) -> dict[str, Any]:
    plain: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return plain


def _status(error: Exception) -> int:
    if isinstance(error, KeyError) and isinstance(error.__context__, httpx2.HTTPStatusError):
        error = error.__context__  # see _error
    if isinstance(error, ApiError):
        code = error.status.code if error.status is not None else None
        if not code and error.response is not None:
            code = error.response.status_code
        return int(code or 0)
    if isinstance(error, httpx2.HTTPStatusError):
        return error.response.status_code
    return 0


def _error(error: Exception) -> KubeError:
    """Every failure as a ``KubeError``: the API's ``Status`` when it sent one."""
    if isinstance(error, KubeError):
        return error
    if isinstance(error, KeyError) and isinstance(error.__context__, httpx2.HTTPStatusError):
        # lightkube reads an error answer's Content-Type header unguarded: an answer without
        # one (a proxy's) surfaces as this KeyError over the real HTTP error.
        error = error.__context__
    if isinstance(error, ApiError):
        return KubeError(
            status=_status(error),
            reason=str(error.status.reason or "Error"),
            message=str(error.status.message or error),
        )
    if isinstance(error, httpx2.HTTPStatusError):
        response = error.response
        try:
            text = response.text
        except httpx2.ResponseNotRead:  # a watch's streamed answer: its body was not read
            text = f"HTTP {response.status_code} {response.reason_phrase}"
        said = _status_body(text)
        return KubeError(
            status=response.status_code,
            reason=str(said.get("reason") or response.reason_phrase or "Error"),
            message=str(said.get("message") or text[:500]),
        )
    if isinstance(error, httpx2.HTTPError | OSError | ConfigError):
        return KubeError(status=0, reason="Unreachable", message=_said(error))
    raise error


def _status_body(text: str) -> dict[str, Any]:
    """The API's ``Status`` in an error answer lightkube did not read as one (it reads only an
    answer whose Content-Type is exactly ``application/json``; ``…; charset=utf-8`` from a
    proxy or another server is not), else ``{}``."""
    if not text.lstrip().startswith("{"):
        return {}
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    if isinstance(body, dict) and body.get("kind") == "Status":
        return body
    return {}


def _said(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _b64(data: Any) -> str | None:
    """Certificate data as a kubeconfig has it (base64 of the PEM), what lightkube reads.

    kopf takes it in either form: PEM (text or bytes), or already base64, as
    ``kopf.login_with_kubeconfig`` passes on a kubeconfig's ``*-data`` fields."""
    if not data:
        return None
    raw = data if isinstance(data, bytes) else str(data).encode()
    if raw.lstrip().startswith(b"-----BEGIN "):
        return base64.b64encode(raw).decode()
    return raw.decode("ascii").strip()
