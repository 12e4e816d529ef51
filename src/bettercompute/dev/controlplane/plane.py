"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, controller-manager and
scheduler as child processes, with what a kubeadm cluster has.

Why it exists: our webhooks, RBAC, CRDs, CSR flow and extended resources must meet the real
API server, authorizer, admission chain and scheduler before a platform team's first install
does, and ``better-compute dev --kube`` gives a newcomer the same cluster to ``kubectl apply``
against. ``ControlPlane.start`` brings one up in a directory of its own (a CA and serving and
client certificates, service-account signing keys, ``--authorization-mode=Node,RBAC``, the
default admission plugins plus ``NodeRestriction``, ``resource.k8s.io/v1``), and hands out
credentials: the cluster admin, static-token users (``users``), nodes (client certificates
``system:node:<name>``) and service accounts (bound tokens from the TokenRequest API).

There are no kubelets: nodes are ``Node`` objects written as a kubelet writes them
(``nodes``). The node lifecycle controller runs with a grace period of a day, so no node goes
``Unknown`` for want of heartbeats while a test runs (``dev`` heartbeats its nodes).

What it must never do: listen beyond 127.0.0.1, leave a process running after ``stop`` (each
is ended by its process group, then killed; ``kill`` does it at once), or keep its directory
after ``running`` ends.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bettercompute.dev.controlplane import pki

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
STARTUP_S = 120.0


#: Metadata of every request when it is answered (a watch: when its stream starts) and when it
#: completes; never the bodies, so Secrets and tokens stay out.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""


class ControlPlaneError(RuntimeError):
    """The control plane did not start; the message carries the failing process's log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ControlPlane:
    root: Path
    binary: Path
    #: Static-token users: name → groups. Users are ordinary users in the
    #: ``system:authenticated`` group (added by the API server); RBAC gives them the rest.
    users: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: How long the CA and every certificate last.
    lifetime: dt.timedelta = pki.LIFETIME
    url: str = ""
    ca: Path = Path()
    admin: pki.Pair | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)
    #: Write the API server's audit log (tests read it; a long-running dev cluster does not
    #: need a file that grows with every request).
    audit: bool = False
    #: The audit log (JSON lines, metadata of every request) when ``audit`` is on.
    audit_log: Path = Path()
    _authority: pki.Authority | None = None

    # --- starting and stopping ---------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def running(
        cls,
        *,
        binary: Path,
        root: Path | None = None,
        users: Mapping[str, tuple[str, ...]] | None = None,
        lifetime: dt.timedelta = pki.LIFETIME,
        audit: bool = False,
    ) -> Iterator[ControlPlane]:
        """Started in ``root`` (a new temporary directory when ``None``; one given must not
        exist or be empty), stopped and ``root`` removed when the block ends."""
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="bc-controlplane-"))
        else:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if any(root.iterdir()):
                raise ControlPlaneError(f"{root} is not empty")
        plane = cls(
            root=root, binary=binary, users=dict(users or {}), lifetime=lifetime, audit=audit
        )
        try:
            plane.start()
            yield plane
        finally:
            plane.stop()
            shutil.rmtree(root, ignore_errors=True)

    def start(self) -> None:
        pki_dir = self.root / "pki"
        pki_dir.mkdir(mode=0o700)
        authority = pki.Authority(pki_dir, lifetime=self.lifetime)
        self._authority = authority
        self.ca = authority.pair.cert
        serving = authority.issue(
            "apiserver",
            common_name="kube-apiserver",
            hosts=(
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "10.96.0.1",
            ),
        )
        self.admin = authority.issue(
            "admin", common_name="kubernetes-admin", organizations=("system:masters",), client=True
        )
        manager = authority.issue(
            "controller-manager", common_name="system:kube-controller-manager", client=True
        )
        scheduler = authority.issue("scheduler", common_name="system:kube-scheduler", client=True)
        sa_keys = pki.service_account_keys(pki_dir)
        self.tokens = {user: f"{secrets.token_hex(16)}" for user in self.users}
        token_file = pki_dir / "tokens.csv"
        token_file.touch(mode=0o600)
        token_file.write_text(
            "".join(
                f'{self.tokens[user]},{user},{user},"{",".join(groups)}"\n'
                for user, groups in self.users.items()
            )
        )

        # Who asked for what and what the authorizer decided, one JSON line per request
        # (tests read it to show the chart's RBAC is sufficient and minimal). Metadata only:
        # no request or response bodies, so no Secret or token is ever written to it.
        audit_args: list[str] = []
        if self.audit:
            audit_policy = self.root / "audit-policy.yaml"
            audit_policy.write_text(AUDIT_POLICY)
            self.audit_log = self.root / "audit.log"
            audit_args = [
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=0",
            ]

        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "etcd",
            [
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-url=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-url=http://127.0.0.1:{etcd_peer}",
            ],
        )
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health", context=None))
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={api_port}",
                "--advertise-address=127.0.0.1",
                # No kubernetes Service endpoints to keep: they would name 127.0.0.1, which
                # Endpoints validation refuses, and nothing here routes to a ClusterIP.
                "--endpoint-reconciler-type=none",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--cert-dir={self.root / 'apiserver-certs'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.ca}",
                f"--service-account-issuer={ISSUER}",
                f"--api-audiences={ISSUER}",
                f"--service-account-key-file={sa_keys.cert}",
                f"--service-account-signing-key-file={sa_keys.key}",
                f"--token-auth-file={token_file}",
                "--authorization-mode=Node,RBAC",
                # The default plugins are on; kubeadm adds NodeRestriction.
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                "--runtime-config=resource.k8s.io/v1=true",
                "--profiling=false",
                *audit_args,
            ],
        )
        context = self.ssl_context(client=self.admin)
        self._wait("kube-apiserver", lambda: _http_ok(f"{self.url}/readyz", context=context))
        manager_config = self.kubeconfig("controller-manager", cert=manager)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={manager_config}",
                f"--authentication-kubeconfig={manager_config}",
                f"--authorization-kubeconfig={manager_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_keys.key}",
                f"--root-ca-file={self.ca}",
                f"--cluster-signing-cert-file={authority.pair.cert}",
                f"--cluster-signing-key-file={authority.pair.key}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                # No kubelet heartbeats here: a grace period longer than any test run.
                "--node-monitor-grace-period=24h",
            ],
        )
        scheduler_config = self.kubeconfig("scheduler", cert=scheduler)
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={scheduler_config}",
                f"--authentication-kubeconfig={scheduler_config}",
                f"--authorization-kubeconfig={scheduler_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
            ],
        )
        # The default service account exists once the controller-manager runs its controllers.
        self._wait(
            "kube-controller-manager",
            lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
        )

    def _spawn(self, name: str, args: Sequence[str]) -> Process:
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [str(self.binary), name, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: a Ctrl-C in a terminal reaches us, not it: stop() ends it.
                start_new_session=True,
            )
        process = Process(name=name, popen=popen, log=log)
        self.processes.append(process)
        return process

    def _wait(self, name: str, ready: Any, timeout_s: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout_s
        process = next(p for p in self.processes if p.name == name)
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with {process.popen.returncode}:\n{process.tail()}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise ControlPlaneError(f"{name} not ready within {timeout_s:.0f} s:\n{process.tail()}")

    def stop(self) -> None:
        """End every process by its pid (SIGTERM, then SIGKILL after 10 s), newest first."""
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.popen.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait(timeout=10)
        self.processes.clear()

    def kill(self) -> None:
        """SIGKILL every process group now, waiting for none (a forced exit: quick, sync)."""
        for process in self.processes:
            if process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.popen.pid, signal.SIGKILL)

    def exited(self) -> Process | None:
        """The first process that is no longer running, if any."""
        return next((p for p in self.processes if p.popen.poll() is not None), None)

    # --- credentials -------------------------------------------------------------------

    def ssl_context(self, *, client: pki.Pair | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context

    def issue_client(self, stem: str, *, user: str, groups: tuple[str, ...] = ()) -> pki.Pair:
        """A client certificate for ``user`` in ``groups`` (a node: ``system:node:<name>`` in
        ``system:nodes``), signed by the cluster's CA."""
        assert self._authority is not None
        return self._authority.issue(stem, common_name=user, organizations=groups, client=True)

    def kubeconfig(
        self, stem: str, *, token: str | None = None, cert: pki.Pair | None = None
    ) -> Path:
        """A kubeconfig file for one identity: a bearer token or a client certificate."""
        user: dict[str, str] = {}
        if token is not None:
            user["token"] = token
        if cert is not None:
            user["client-certificate"] = str(cert.cert)
            user["client-key"] = str(cert.key)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "controlplane",
                    "cluster": {"server": self.url, "certificate-authority": str(self.ca)},
                }
            ],
            "users": [{"name": stem, "user": user}],
            "contexts": [{"name": stem, "context": {"cluster": "controlplane", "user": stem}}],
            "current-context": stem,
        }
        path = self.root / f"{stem}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def admin_kubeconfig(self) -> Path:
        return self.kubeconfig("admin", cert=self.admin)

    def service_account_token(
        self,
        namespace: str,
        name: str,
        *,
        pod: Mapping[str, Any] | None = None,
        audiences: Sequence[str] = (ISSUER,),
        seconds: int = 3600,
    ) -> str:
        """A bound token for a service account (TokenRequest), bound to ``pod`` when given:
        a pod on a node gives a token whose user carries the node's name and uid."""
        spec: dict[str, Any] = {"audiences": list(audiences), "expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            }
        answer = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(answer["status"]["token"])

    # --- plain calls as the admin (set-up; tests use the clients under test) -------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        token: str | None = None,
        client: pki.Pair | None = None,
    ) -> Any:
        """One call, as the admin unless a ``token`` or ``client`` certificate says who; the
        decoded answer. A non-2xx answer raises ``ApiError``.

        A 429 (a CRD's storage still initializing, priority and fairness shedding) is tried
        again after its ``Retry-After``, for up to 30 s, as client-go does."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return self._request_once(method, path, body, content_type, token, client)
            except ApiError as e:
                if e.status != 429 or time.monotonic() > deadline:
                    raise
                time.sleep(min(1.0, max(0.1, e.retry_after)))

    def _request_once(
        self,
        method: str,
        path: str,
        body: Any,
        content_type: str,
        token: str | None,
        client: pki.Pair | None,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        context = self.ssl_context(client=None if token else client or self.admin)
        call = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(call, context=context, timeout=30) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                status = json.loads(raw)
            except ValueError:
                status = {"message": raw.decode(errors="replace")}
            retry = e.headers.get("Retry-After") if e.headers else None
            raise ApiError(e.code, status, retry_after=float(retry or 0)) from None
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        try:
            return self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: Mapping[str, Any], *, manager: str = "tests") -> Any:
        """Server-side apply of one object as the admin (create or update)."""
        path = object_path(obj) + f"?fieldManager={manager}&force=true"
        return self.request("PATCH", path, dict(obj), content_type="application/apply-patch+yaml")

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input_text: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl of the same release, as the admin unless ``kubeconfig`` says."""
        config = kubeconfig or self.admin_kubeconfig()
        result = subprocess.run(
            [str(self.binary), "kubectl", f"--kubeconfig={config}", *args],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise ApiError(0, {"message": f"kubectl {' '.join(args)}: {result.stderr.strip()}"})
        return result


class ApiError(Exception):
    def __init__(self, status: int, body: Mapping[str, Any], *, retry_after: float = 0) -> None:
        super().__init__(f"HTTP {status}: {body.get('message', body)}")
        self.status = status
        self.retry_after = retry_after
        self.body = body
        self.reason = str(body.get("reason", ""))


#: Resource paths of the kinds set-up applies (core and our own; the rest through ``plural``).
_PLURALS = {
    "Namespace": ("", "v1", "namespaces", False),
    "ServiceAccount": ("", "v1", "serviceaccounts", True),
    "Secret": ("", "v1", "secrets", True),
    "ConfigMap": ("", "v1", "configmaps", True),
    "Service": ("", "v1", "services", True),
    "Node": ("", "v1", "nodes", False),
    "Pod": ("", "v1", "pods", True),
    "ClusterRole": ("rbac.authorization.k8s.io", "v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", False),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings", True),
    "CustomResourceDefinition": (
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        False,
    ),
    "MutatingWebhookConfiguration": (
        "admissionregistration.k8s.io",
        "v1",
        "mutatingwebhookconfigurations",
        False,
    ),
    "ValidatingWebhookConfiguration": (
        "admissionregistration.k8s.io",
        "v1",
        "validatingwebhookconfigurations",
        False,
    ),
    "ValidatingAdmissionPolicy": (
        "admissionregistration.k8s.io",
        "v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "admissionregistration.k8s.io",
        "v1",
        "validatingadmissionpolicybindings",
        False,
    ),
    "DeviceClass": ("resource.k8s.io", "v1", "deviceclasses", False),
    "ResourceSlice": ("resource.k8s.io", "v1", "resourceslices", False),
    "ResourceClaim": ("resource.k8s.io", "v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("resource.k8s.io", "v1", "resourceclaimtemplates", True),
    "ClusterKopfPeering": ("kopf.dev", "v1", "clusterkopfpeerings", False),
    "KopfPeering": ("kopf.dev", "v1", "kopfpeerings", True),
}
_OUR_PLURALS = {
    "Reservation": ("reservations", True),
    "GPUPool": ("gpupools", False),
    "GPUNode": ("gpunodes", False),
    "GPUQuota": ("gpuquotas", False),
    "DeviceAllocation": ("deviceallocations", True),
    "EventSubscription": ("eventsubscriptions", True),
}


def object_path(obj: Mapping[str, Any]) -> str:
    kind = obj["kind"]
    meta = obj.get("metadata") or {}
    if kind in _PLURALS:
        group, version, plural, namespaced = _PLURALS[kind]
    elif kind in _OUR_PLURALS:
        group, version = obj["apiVersion"].split("/")
        plural, namespaced = _OUR_PLURALS[kind]
    else:
        raise KeyError(f"no path known for kind {kind}")
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    where = f"/namespaces/{meta['namespace']}" if namespaced else ""
    return f"{base}{where}/{plural}/{meta['name']}"


def _http_ok(url: str, *, context: ssl.SSLContext | None) -> bool:
    with urllib.request.urlopen(url, context=context, timeout=5) as response:
        return bool(response.status == 200)
