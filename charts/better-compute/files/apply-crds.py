"""Apply the chart's CRDs with server-side apply, then wait until each is Established.

Run by the chart's pre-install and pre-upgrade hook Job (templates/crd-upgrade.yaml) in the
chart's own image, with nothing but the Python standard library: no kubectl, no client package.
Helm installs the chart's crds/ folder on the first install only and never upgrades it; this
brings every later chart version's CRD schemas to the cluster before the release's objects
change.

Each file of the CRD folder (argument 1, default /etc/bcd/crds) is one CRD, named by its file
name (<plural>.<group>.yaml), sent as is: PATCH with application/apply-patch+yaml, field
manager better-compute-chart, force (the chart owns every field it sets, whoever set it
before). It never deletes anything: a CRD the chart no longer ships, and every custom resource,
stays. It talks to the API server of the pod's service account (KUBERNETES_SERVICE_HOST and
_PORT, the token and CA in BCD_SERVICE_ACCOUNT_DIR, default the mounted service account).

Exit status: 0 when every CRD is applied and Established; 1, after saying why on stderr, when
the API server refuses one (its Status message) or one is not Established within
BCD_CRD_WAIT_S seconds (default 120). Connection errors, 429 and 5xx answers are retried for
BCD_CRD_RETRY_S seconds (default 60).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

FIELD_MANAGER = "better-compute-chart"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
RETRIED = {429, 500, 502, 503, 504}


class Refused(Exception):
    """The API server's answer, when it is not one to retry."""


def api_base() -> str:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"


def call(
    method: str,
    path: str,
    *,
    token: str,
    context: ssl.SSLContext,
    body: bytes | None = None,
    content_type: str | None = None,
) -> dict:
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    if content_type:
        headers["Content-Type"] = content_type
    deadline = time.monotonic() + float(os.environ.get("BCD_CRD_RETRY_S", "60"))
    pause = 0.5
    while True:
        request = urllib.request.Request(
            api_base() + path, data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            try:
                message = json.loads(text).get("message") or text
            except ValueError:
                message = text
            if e.code not in RETRIED or time.monotonic() > deadline:
                raise Refused(f"{method} {path}: HTTP {e.code}: {message}") from None
            problem = f"HTTP {e.code}: {message}"
        except (urllib.error.URLError, OSError) as e:
            if time.monotonic() > deadline:
                raise Refused(f"{method} {path}: {e}") from None
            problem = str(e)
        print(f"retrying {method} {path} in {pause:g} s: {problem}", file=sys.stderr)
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


def established(crd: dict) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "/etc/bcd/crds")
    account = Path(
        os.environ.get("BCD_SERVICE_ACCOUNT_DIR", "/var/run/secrets/kubernetes.io/serviceaccount")
    )
    token = (account / "token").read_text(encoding="utf-8").strip()
    context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    files = sorted(folder.glob("*.yaml"))
    if not files:
        print(f"no CRD files in {folder}", file=sys.stderr)
        return 1
    query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
    names = []
    try:
        for path in files:
            name = path.name[: -len(".yaml")]
            crd = call(
                "PATCH",
                f"{CRDS}/{name}?{query}",
                token=token,
                context=context,
                body=path.read_bytes(),
                content_type="application/apply-patch+yaml",
            )
            generation = (crd.get("metadata") or {}).get("generation")
            print(f"applied {name} (generation {generation})")
            names.append(name)
        deadline = time.monotonic() + float(os.environ.get("BCD_CRD_WAIT_S", "120"))
        for name in names:
            while not established(call("GET", f"{CRDS}/{name}", token=token, context=context)):
                if time.monotonic() > deadline:
                    raise Refused(f"{name} is not Established yet: look at its status.conditions")
                time.sleep(1)
            print(f"{name} is Established")
    except Refused as e:
        print(f"the CRDs were not applied: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
