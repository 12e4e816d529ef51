"""CRDs upgraded by the chart: the pre-install and pre-upgrade hook Job, and an upgrade from 0.1.0.

Helm installs ``crds/`` on the first install only. The chart's hook Job applies our bcd.dev CRDs
(server-side) before every install and upgrade (``templates/crd-upgrade.yaml``, the program
``files/apply-crds.py``). Checked here:

- the hook: what Helm runs and when (hook annotations, weights, delete policies), the files it
  applies (the repository's ``crds/``, byte for byte), how it runs (the chart's image, the
  operator's security contexts), and that ``crds.upgrade.enabled=false`` leaves it out;
- nothing a user created is deleted: no CRD is ever an object of the release (so no uninstall,
  rollback or later chart deletes one), the hook may not delete, and kopf's CRDs are not its;
- an upgrade from chart 0.1.0 as first released (``fixtures/crds-0.1.0.json``, commit 1532659;
  later 0.1.0 commits changed the CRDs without a new chart version): every CRD it installed is
  applied again with the newer schema (GPUQuota's CRD is new, Reservations have new fields), no
  served version is dropped and no spec field is pruned;
- the program itself, run as the Job runs it against an API server stand-in over TLS: one
  server-side apply per CRD with the file as is, a wait for Established, retries, a refusal
  that fails the hook with the API server's message, and only calls the hook's RBAC allows.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.chart import authorizing, rendering, upgrading

NAME = "bc-better-compute-crd-upgrade"
HOOK = "pre-install,pre-upgrade"
PROGRAM = rendering.CHART / "files" / "apply-crds.py"
REPO_CRDS = {
    yaml.safe_load(p.read_text(encoding="utf-8"))["metadata"]["name"]: p
    for p in sorted((rendering.ROOT / "crds").glob("*.yaml"))
}
PREVIOUS = "0.1.0"

#: Fields of 0.1.0 an upgrade drops, each with why no user data is lost. Spec fields: none.
DROPPED_STATUS = {
    "reservations.bcd.dev": {
        # The operator writes status; these moved to status.conditionDetails (3ca4915) and are
        # written again there at its next projection.
        ".status.conditions[].nodes",
        ".status.conditions[].nodes[]",
        ".status.conditions[].pods",
        ".status.conditions[].pods[]",
        ".status.conditions[].since",
    },
}
#: Fields of 0.1.0 whose type an upgrade changes, each a widening that keeps stored values.
WIDENED = {
    # integer epoch seconds → RFC 3339 strings (3ca4915): int-or-string still accepts a stored
    # integer, and the CEL format rule ratchets (1.30 and later: an unchanged value is kept).
    ("reservations.bcd.dev", ".spec.start"): ("integer", "int-or-string"),
    ("reservations.bcd.dev", ".spec.until"): ("integer", "int-or-string"),
    # true → true or {api: devicePlugin | dra} (issue 28): a stored boolean still passes the
    # field's CEL rule, and is read as before.
    ("gpupools.bcd.dev", ".spec.policy.kubernetes"): ("boolean", "any"),
    # epoch ms → RFC 3339 (issue 31: times people read). Status, which only the operator
    # writes: its next projection writes the new form; until then the stored integer is kept
    # (validation ratchets on unchanged values, 1.30 and later) and kubectl bcd reads both.
    ("reservations.bcd.dev", ".status.leaseExpiresAt"): ("integer", "string"),
    ("reservations.bcd.dev", ".status.extension.availableUntil"): ("integer", "string"),
}


def _hook_objects(rendered: rendering.Rendered) -> list[dict[str, Any]]:
    return [
        o
        for o in rendered.objects
        if (o["metadata"].get("annotations") or {}).get("helm.sh/hook") is not None
    ]


def _config_map(rendered: rendering.Rendered) -> dict[str, Any]:
    return rendered.one("ConfigMap", NAME)


# --- what Helm runs, and when ----------------------------------------------------------------


@pytest.mark.parametrize("upgrade", [False, True], ids=["install", "upgrade"])
def test_the_hook_runs_before_install_and_upgrade(render: Callable, upgrade: bool):
    rendered = render({}, upgrade=upgrade)
    hooks = _hook_objects(rendered)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in hooks) == sorted(
        (kind, NAME)
        for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job")
    )
    weights = {}
    for obj in hooks:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == HOOK
        # Gone once it worked; a failed Job stays for its logs until the next try.
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        weights[obj["kind"]] = int(annotations["helm.sh/hook-weight"])
    # Helm runs hooks by weight: the account, its rights and the files before the Job.
    assert max(w for kind, w in weights.items() if kind != "Job") < weights["Job"]


def test_the_job_runs_the_program_in_the_charts_image_locked_down(everything: rendering.Rendered):
    job = everything.one("Job", NAME)
    pod = job["spec"]["template"]["spec"]
    operator = rendering.pod_spec(everything.one("StatefulSet"))
    assert pod["serviceAccountName"] == NAME
    assert pod["restartPolicy"] == "Never"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # Where and as whom the operator runs.
    assert pod["securityContext"] == operator["securityContext"]
    assert pod["nodeSelector"] == operator["nodeSelector"]
    assert pod["tolerations"] == operator["tolerations"]
    (container,) = pod["containers"]
    assert container["image"] == operator["containers"][0]["image"]
    assert container["securityContext"] == operator["containers"][0]["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["resources"]["limits"] == {"memory": "96Mi"}  # crds.upgrade.resources
    python, program, folder = container["command"]
    assert python == "python"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (program, folder + "/reservations.bcd.dev.yaml"):
        directory, file = path.rsplit("/", 1)
        volume = volumes[mounts[directory]]["configMap"]
        assert volume["name"] == NAME
        assert file in {item["path"] for item in volume["items"]}
    # The program waits 60 s + 120 s at most; the Job ends before Helm's 5 minutes.
    assert 180 < job["spec"]["activeDeadlineSeconds"] < 300


def test_the_hook_applies_the_repositorys_crds_byte_for_byte(defaults: rendering.Rendered):
    data = _config_map(defaults)["data"]
    ours = {n: p for n, p in REPO_CRDS.items() if n.endswith(".bcd.dev")}
    assert set(data) == {f"{n}.yaml" for n in ours} | {"apply-crds.py"}
    for name, path in ours.items():
        assert data[f"{name}.yaml"] == path.read_text(encoding="utf-8"), name
    assert data["apply-crds.py"] == PROGRAM.read_text(encoding="utf-8")
    # The Job mounts every one, and may touch exactly those.
    job = defaults.one("Job", NAME)
    (crds,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "crds"]
    assert {i["key"] for i in crds["configMap"]["items"]} == {f"{n}.yaml" for n in ours}
    (rule,) = defaults.one("ClusterRole", NAME)["rules"]
    assert rule["resourceNames"] == sorted(ours)
    assert sorted(rule["verbs"]) == ["create", "get", "patch"]


def test_it_can_be_turned_off(render: Callable):
    assert _hook_objects(render({"crds": {"upgrade": {"enabled": False}}})) == []


def test_values_of_an_older_chart_keep_it_on(render: Callable):
    # `helm upgrade --reuse-values` from 0.1.0 may render without a crds key at all.
    assert len(_hook_objects(render({"crds": None}, upgrade=True))) == 5


# --- nothing a user created is deleted --------------------------------------------------------


@pytest.mark.parametrize("upgrade", [False, True], ids=["install", "upgrade"])
def test_no_crd_is_an_object_of_the_release(render: Callable, upgrade: bool):
    # Helm deletes a release's objects on uninstall, and on an upgrade or rollback to a chart
    # without them; CRDs are never among them, so every custom resource stays.
    from tests.chart.conftest import full

    rendered = render(full(), upgrade=upgrade)
    assert rendered.of("CustomResourceDefinition") == []
    for obj in _hook_objects(rendered):
        for rule in obj.get("rules", []):
            assert not {"delete", "deletecollection", "*"} & set(rule["verbs"]), rule


def test_kopfs_crds_stay_install_once(chart, defaults: rendering.Rendered):
    shipped = {c["filename"].rsplit("/", 1)[-1] for c in chart.crds}
    assert {"clusterkopfpeerings.yaml", "kopfpeerings.yaml"} <= shipped
    assert not [k for k in _config_map(defaults)["data"] if "kopf" in k]


# --- an upgrade from 0.1.0 ---------------------------------------------------------------------


def test_an_upgrade_from_0_1_0_applies_every_crd_with_the_newer_schema(render: Callable):
    previous = upgrading.load(PREVIOUS)["crds"]
    rendered = render({}, upgrade=True)
    applied = {
        key.removesuffix(".yaml"): yaml.safe_load(text)
        for key, text in _config_map(rendered)["data"].items()
        if key.endswith(".yaml")
    }
    shipped = upgrading.summaries(
        [
            yaml.safe_load(p.read_text(encoding="utf-8"))
            for p in (rendering.CHART / "crds").glob("*.yaml")
        ]
    )
    # Every CRD 0.1.0 installed is still shipped; ours are applied by the upgrade, kopf's are
    # unchanged (crds/ installed them, and nothing needs to).
    assert set(previous) <= set(shipped)
    for name, old in previous.items():
        new = shipped[name]
        if old["group"] == "bcd.dev":
            assert upgrading.summary(applied[name]) == new, name
        else:
            assert new == old, name
        assert {k: new[k] for k in ("group", "kind", "plural", "scope")} == {
            k: old[k] for k in ("group", "kind", "plural", "scope")
        }, name
        for version, was in old["versions"].items():
            now = new["versions"].get(version)
            # A version objects were stored in or read through is still there, and served.
            assert now is not None, (name, version)
            assert now["served"] or not was["served"], (name, version)
            removed = set(was["fields"]) - set(now["fields"])
            assert not [f for f in removed if f.startswith(".spec")], (name, removed)
            assert removed == DROPPED_STATUS.get(name, set()), (name, removed)
            changed = {
                (name, f): (was["fields"][f], now["fields"][f])
                for f in set(was["fields"]) & set(now["fields"])
                if was["fields"][f] != now["fields"][f]
            }
            assert changed == {k: v for k, v in WIDENED.items() if k[0] == name}
    # What the upgrade brings: a new CRD, and the newer Reservation schema.
    assert "gpuquotas.bcd.dev" not in previous
    assert "gpuquotas.bcd.dev" in applied
    assert "eventsubscriptions.bcd.dev" not in previous
    assert "eventsubscriptions.bcd.dev" in applied
    reservation = shipped["reservations.bcd.dev"]["versions"]["v1alpha1"]["fields"]
    was = previous["reservations.bcd.dev"]["versions"]["v1alpha1"]["fields"]
    for field in (".status.window.start", ".status.conditionDetails{}.since", ".status.leaseUntil"):
        assert field in reservation, field
        assert field not in was, field


def test_the_chart_version_moved_on_by_a_minor_step():
    chart = yaml.safe_load((rendering.CHART / "Chart.yaml").read_text(encoding="utf-8"))
    now = [int(p) for p in chart["version"].split(".")]
    was = [int(p) for p in upgrading.load(PREVIOUS)["chart"].split(".")]
    assert now[0] == was[0], chart["version"]
    assert now[1] > was[1], chart["version"]


# --- the program, against an API server stand-in ---------------------------------------------


class StandIn:
    """CRDs over HTTPS as the API server serves them, for the program's calls."""

    def __init__(self, existing: set[str]) -> None:
        self.crds: dict[str, dict[str, Any]] = {n: {"metadata": {"name": n}} for n in existing}
        self.requests: list[dict[str, Any]] = []
        #: RBAC attributes of each request, with the create that an apply which makes a new
        #: object is also authorized as (apiserver's patch handler: createAuthorizerAttributes).
        self.attributes: list[authorizing.Attributes] = []
        self.refuse: dict[str, tuple[int, str]] = {}
        self.unavailable = 0  # the next n requests get 503
        self.gets_until_established = 1
        self.lock = threading.Lock()

    def handle(self, method: str, url: str, headers: Any, body: bytes) -> tuple[int, dict]:
        parsed = urllib.parse.urlsplit(url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        with self.lock:
            self.requests.append(
                {"method": method, "path": parsed.path, "query": query, "headers": headers}
                | {"body": body}
            )
            if self.unavailable:
                self.unavailable -= 1
                return 503, {"kind": "Status", "message": "etcd is resting"}
            attributes = authorizing.attributes(method, parsed.path, query)
            self.attributes.append(attributes)
            name = attributes.name
            if method == "PATCH":
                if name in self.refuse:
                    code, message = self.refuse[name]
                    return code, {"kind": "Status", "message": message}
                if name not in self.crds:
                    self.attributes.append(
                        authorizing.Attributes(
                            verb="create",
                            path=parsed.path,
                            group=attributes.group,
                            resource=attributes.resource,
                            name=name,
                        )
                    )
                obj = yaml.safe_load(body)
                assert obj["metadata"]["name"] == name
                generation = self.crds.get(name, {}).get("metadata", {}).get("generation", 0)
                obj["metadata"]["generation"] = generation + 1
                obj["status"] = {"conditions": []}
                obj["gets"] = 0
                self.crds[name] = obj
                return 200, obj
            if method == "GET" and name in self.crds:
                obj = self.crds[name]
                obj["gets"] = obj.get("gets", 0) + 1
                if obj["gets"] >= self.gets_until_established:
                    obj["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
                return 200, obj
            return 404, {"kind": "Status", "message": f"{name} not found"}


def _certificate(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[StandIn, dict[str, str]]]:
    """A stand-in with 0.1.0's CRDs in place, and the environment the Job's pod would have."""
    stand_in = StandIn(existing=set(upgrading.load(PREVIOUS)["crds"]))

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            code, obj = stand_in.handle(self.command, self.path, dict(self.headers), body)
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    cert, key = _certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("hook-token\n", encoding="utf-8")
    (account / "ca.crt").write_bytes(cert.read_bytes())
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(server.server_address[1]),
        "BCD_SERVICE_ACCOUNT_DIR": str(account),
        "BCD_CRD_RETRY_S": "10",
        "BCD_CRD_WAIT_S": "10",
    }
    try:
        yield stand_in, env
    finally:
        server.shutdown()
        server.server_close()


def _run_the_job(
    rendered: rendering.Rendered, env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """The program and the CRD files as the Job's pod has them (from the rendered ConfigMap),
    run as its command runs them."""
    data = _config_map(rendered)["data"]
    folder = tmp_path / "crds"
    folder.mkdir()
    for key, text in data.items():
        if key.endswith(".yaml"):
            (folder / key).write_text(text, encoding="utf-8")
    program = tmp_path / "apply-crds.py"
    program.write_text(data["apply-crds.py"], encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-I", str(program), str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_program_applies_every_crd_and_waits_until_established(
    api, defaults: rendering.Rendered, tmp_path: Path
):
    stand_in, env = api
    stand_in.gets_until_established = 2  # the first look finds it not Established yet
    done = _run_the_job(defaults, env, tmp_path)
    assert done.returncode == 0, done.stderr
    ours = sorted(n for n in REPO_CRDS if n.endswith(".bcd.dev"))
    patches = [r for r in stand_in.requests if r["method"] == "PATCH"]
    assert [r["path"].rsplit("/", 1)[-1] for r in patches] == ours
    for request in patches:
        name = request["path"].rsplit("/", 1)[-1]
        assert request["headers"]["Content-Type"] == "application/apply-patch+yaml"
        assert request["headers"]["Authorization"] == "Bearer hook-token"
        assert request["query"] == {"fieldManager": "better-compute-chart", "force": "true"}
        assert request["body"] == REPO_CRDS[name].read_bytes()  # the file, as is
    for name in ours:
        assert f"{name} is Established" in done.stdout
    # GPUQuota's and EventSubscription's CRDs were new: the apply created them.
    created = [a.name for a in stand_in.attributes if a.verb == "create"]
    assert created == ["eventsubscriptions.bcd.dev", "gpuquotas.bcd.dev"]
    # Every call, the implied creates included, is one the hook's RBAC allows; none deletes.
    rbac = authorizing.authorizer_for(defaults.objects, namespace=rendering.NAMESPACE, name=NAME)
    for attributes in stand_in.attributes:
        assert rbac.allows(attributes), str(attributes)
    assert {a.verb for a in stand_in.attributes} == {"patch", "create", "get"}


def test_a_refusal_fails_the_hook_with_the_api_servers_message(
    api, defaults: rendering.Rendered, tmp_path: Path
):
    stand_in, env = api
    message = "spec.versions: Invalid value: must have exactly one version marked as storage"
    stand_in.refuse["reservations.bcd.dev"] = (422, message)
    done = _run_the_job(defaults, env, tmp_path)
    assert done.returncode == 1
    assert "reservations.bcd.dev" in done.stderr
    assert "HTTP 422" in done.stderr
    assert message in done.stderr


def test_an_api_server_that_is_briefly_away_is_waited_for(
    api, defaults: rendering.Rendered, tmp_path: Path
):
    stand_in, env = api
    stand_in.unavailable = 2
    done = _run_the_job(defaults, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("retrying PATCH") == 2


def test_a_crd_never_established_fails_the_hook(api, defaults: rendering.Rendered, tmp_path):
    stand_in, env = api
    stand_in.gets_until_established = 10_000
    done = _run_the_job(defaults, env | {"BCD_CRD_WAIT_S": "1"}, tmp_path)
    assert done.returncode == 1
    assert "is not Established yet" in done.stderr
