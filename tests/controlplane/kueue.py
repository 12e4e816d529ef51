"""Kueue for the real-control-plane tests: its CRDs from its Go module, and its objects.

Why it exists: our AdmissionCheck controller (``operator/kueuechecks.py``) is tested against
Kueue's own CRDs, served by the real kube-apiserver, so the schema and the status subresource
are Kueue's. The CRDs come from the Go module ``sigs.k8s.io/kueue`` (the version below: the
release built against ``k8s.io/*`` v0.34 like our control plane, serving only ``v1beta1``),
downloaded through the Go module proxy as the control plane's own modules are; never from
anywhere else. The builders write Kueue's objects as Kueue and an admin would (the tests play
Kueue's controllers, see ``test_real_kueue.py``).

What it must never do: download anything but the Go module, or write a Workload's
``status.admissionChecks`` entry state other than Kueue's own ``Pending`` (what our controller
writes is what the tests assert).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bettercompute.operator import kueuechecks

#: The Kueue release whose CRDs the tests install (``docs/reference/kueue-admission-checks.md``).
KUEUE_VERSION = "v0.14.0"
API = f"{kueuechecks.GROUP}/{kueuechecks.VERSION}"
PREFIX = f"/apis/{API}"


class KueueUnavailable(RuntimeError):
    """Go is missing or the module could not be downloaded; the message says which."""


def module_dir(version: str = KUEUE_VERSION) -> Path:
    """Where Go keeps ``sigs.k8s.io/kueue@version`` (downloaded first if needed)."""
    go = shutil.which("go")
    if go is None:
        raise KueueUnavailable("Go is not installed")
    result = subprocess.run(
        [go, "mod", "download", "-json", f"sigs.k8s.io/kueue@{version}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    try:
        answer = json.loads(result.stdout or "{}")
    except json.JSONDecodeError:
        answer = {}
    if result.returncode != 0 or "Dir" not in answer:
        raise KueueUnavailable(
            f"go mod download sigs.k8s.io/kueue@{version}: "
            f"{answer.get('Error') or result.stderr[-2000:]}"
        )
    return Path(answer["Dir"])


def crds(version: str = KUEUE_VERSION) -> list[dict[str, Any]]:
    """Every CRD of Kueue's ``config/components/crd/bases``."""
    bases = module_dir(version) / "config" / "components" / "crd" / "bases"
    found = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(bases.glob("*.yaml"))]
    return [c for c in found if c and c.get("kind") == "CustomResourceDefinition"]


#: Kueue's kinds the tests write: plural, namespaced.
PLURALS = {
    "AdmissionCheck": ("admissionchecks", False),
    "ResourceFlavor": ("resourceflavors", False),
    "ClusterQueue": ("clusterqueues", False),
    "LocalQueue": ("localqueues", True),
    "Workload": ("workloads", True),
}


def collection(obj: dict[str, Any]) -> str:
    """The API path to POST a Kueue object to."""
    plural, namespaced = PLURALS[obj["kind"]]
    where = f"/namespaces/{obj['metadata']['namespace']}" if namespaced else ""
    return f"{PREFIX}{where}/{plural}"


# --- objects, as an admin and Kueue write them ---------------------------------------------------


def admission_check(name: str, *, controller: str = kueuechecks.CONTROLLER_NAME) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "AdmissionCheck",
        "metadata": {"name": name},
        "spec": {"controllerName": controller},
    }


def resource_flavor(name: str = "default-flavor") -> dict[str, Any]:
    return {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name}}


def cluster_queue(name: str, *, checks: list[str], gpus: int = 16) -> dict[str, Any]:
    """A ClusterQueue that counts our shared resource ``bcd.dev/gpu`` and lists ``checks``."""
    return {
        "apiVersion": API,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "admissionChecks": checks,
            "resourceGroups": [
                {
                    "coveredResources": ["bcd.dev/gpu"],
                    "flavors": [
                        {
                            "name": "default-flavor",
                            "resources": [{"name": "bcd.dev/gpu", "nominalQuota": gpus}],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(namespace: str, name: str, *, cluster_queue: str) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue},
    }


def pod_template(*, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"labels": dict(labels or {})},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "train",
                    "image": "registry.example/train:1",
                    "resources": {
                        "requests": {"bcd.dev/gpu": str(gpus)},
                        "limits": {"bcd.dev/gpu": str(gpus)},
                    },
                }
            ],
        },
    }


def job(namespace: str, name: str, *, gpus: int, annotations: dict[str, str]) -> dict[str, Any]:
    """A Job as a user writes it for Kueue (Kueue's webhook would suspend it: it is created
    suspended here, so the controller-manager starts no pod)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kueue.x-k8s.io/queue-name": "team"},
            "annotations": dict(annotations),
        },
        "spec": {"suspend": True, "template": pod_template(gpus=gpus)},
    }


def workload(
    namespace: str,
    name: str,
    *,
    gpus: int,
    count: int = 1,
    labels: dict[str, str] | None = None,
    template_labels: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Workload as Kueue makes it for a Job: the job's pod template as pod set ``main``, a
    controller owner reference to the Job when ``owner`` is given."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        meta["labels"]["kueue.x-k8s.io/job-uid"] = owner["metadata"]["uid"]
    return {
        "apiVersion": API,
        "kind": "Workload",
        "metadata": meta,
        "spec": {
            "queueName": "team",
            "podSets": [
                {
                    "name": "main",
                    "count": count,
                    "template": pod_template(gpus=gpus, labels=template_labels),
                }
            ],
        },
    }


def pending_checks(names: list[str], *, now: str) -> dict[str, Any]:
    """The status Kueue's workload controller writes when it adds the ClusterQueue's checks."""
    return {
        "status": {
            "admissionChecks": [
                {"name": n, "state": "Pending", "message": "", "lastTransitionTime": now}
                for n in sorted(names)
            ]
        }
    }


# --- Kueue's controller manager ------------------------------------------------------------------

#: Kueue's namespace, and the Secret its certificate rotator keeps its webhook certificate in.
KUEUE_NAMESPACE = "kueue-system"
KUEUE_CERT_SECRET = "kueue-webhook-server-cert"


def manager_config(*, cert_dir: Path, webhook_port: int) -> str:
    """Kueue's Configuration for the tests (``docs/kueue.md``, "Real Kueue"): no leader
    election, batch/v1 Jobs only, its certificate rotator on (with it off, Kueue reads a metrics
    certificate from a fixed path under /etc), metrics and probes on no port we need."""
    return "\n".join(
        [
            "apiVersion: config.kueue.x-k8s.io/v1beta1",
            "kind: Configuration",
            f"namespace: {KUEUE_NAMESPACE}",
            "health:",
            '  healthProbeBindAddress: "127.0.0.1:0"',
            "metrics:",
            '  bindAddress: "0"',
            "webhook:",
            "  host: 127.0.0.1",
            f"  port: {webhook_port}",
            f"  certDir: {cert_dir}",
            "leaderElection:",
            "  leaderElect: false",
            "internalCertManagement:",
            "  enable: true",
            "integrations:",
            '  frameworks: ["batch/job"]',
            "",
        ]
    )


def write_webhook_pair(cert_dir: Path) -> None:
    """A self-signed ``tls.crt``/``tls.key`` in ``cert_dir``, where a kubelet would mount
    Kueue's certificate Secret: its rotator waits for the files before Kueue starts its
    controllers, and no kubelet runs here. Kueue's webhooks are never called (not registered)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kueue-webhook-service")])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "tls.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (cert_dir / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
