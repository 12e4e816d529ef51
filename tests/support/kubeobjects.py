"""Pure rules on Kubernetes requests and objects for the API server stand-in.

Why it exists: the stand-in (``tests/support/kube.py``) answers as a real API server does, and
the rules it follows are plain functions on dicts: how a resource is named (``Ref`` and the
constants tests use), how a URL path reads, label and field selectors, JSON merge-patch,
optimistic concurrency on ``resourceVersion``, name and label validation, and the ``Status``
failures a real server answers with.

Who calls it: ``tests/support/kube.py``, ``tests/support/kubeserver.py`` and tests naming
resources. What it must never do: keep state or do I/O beyond reading the request it is given.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web
import kmock

Matcher = Callable[[Mapping[str, Any]], bool]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ref:
    """Names a resource the way its URL does: group, version, plural; and its scope."""

    group: str
    version: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(group=self.group, version=self.version, plural=self.plural)

    def path(
        self, *, namespace: str | None = None, name: str | None = None, subresource: str = ""
    ) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        scope = f"/namespaces/{namespace}" if namespace is not None else ""
        tail = f"/{name}" if name is not None else ""
        tail += f"/{subresource}" if subresource else ""
        return f"{root}{scope}/{self.plural}{tail}"


NAMESPACES = Ref(group="", version="v1", plural="namespaces", namespaced=False)
EVENTS = Ref(group="", version="v1", plural="events", namespaced=True)
SECRETS = Ref(group="", version="v1", plural="secrets", namespaced=True)
SERVICE_ACCOUNTS = Ref(group="", version="v1", plural="serviceaccounts", namespaced=True)
CLUSTER_KOPF_PEERINGS = Ref(
    group="kopf.dev", version="v1", plural="clusterkopfpeerings", namespaced=False
)
KOPF_PEERINGS = Ref(group="kopf.dev", version="v1", plural="kopfpeerings", namespaced=True)
TOKEN_REVIEWS = Ref(
    group="authentication.k8s.io", version="v1", plural="tokenreviews", namespaced=False
)
RESERVATIONS = Ref(group="bcd.dev", version="v1alpha1", plural="reservations", namespaced=True)
GPUPOOLS = Ref(group="bcd.dev", version="v1alpha1", plural="gpupools", namespaced=False)
GPUNODES = Ref(group="bcd.dev", version="v1alpha1", plural="gpunodes", namespaced=False)
GPUQUOTAS = Ref(group="bcd.dev", version="v1alpha1", plural="gpuquotas", namespaced=False)
DEVICEALLOCATIONS = Ref(
    group="bcd.dev", version="v1alpha1", plural="deviceallocations", namespaced=True
)

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SERVER_FIELDS = ("uid", "creationTimestamp", "resourceVersion", "generation")
DELETION_FIELDS = ("deletionTimestamp", "deletionGracePeriodSeconds")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def failure(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """A Kubernetes ``Status`` failure, rendered by kmock as the response body."""
    return kmock.KubernetesError(
        status=code, reason=reason, message=message, details=details or {"causes": []}
    )


def not_found() -> kmock.KubernetesError:
    return failure(404, "NotFound", "the server could not find the requested resource")


def api_version_of(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else f"{resource.version}"


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- selectors -----------------------------------------------------------------------------


def parse_label_selector(text: str) -> Matcher:
    """Parse a ``labelSelector`` into a test on an object; bad syntax is a 400."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for part in re.split(r",(?![^()]*\))", text):
        term = part.strip()
        if not term:
            continue
        if m := re.fullmatch(r"([^\s=!(),]+)\s+(in|notin)\s*\(([^()]*)\)", term):
            key, values = m[1], {v.strip() for v in m[3].split(",")}
            inside = m[2] == "in"
            tests.append(lambda ls, k=key, vs=values, i=inside: (ls.get(k) in vs) == i)
        elif m := re.fullmatch(r"!\s*([^\s=!(),]+)", term):
            tests.append(lambda ls, k=m[1]: k not in ls)
        elif m := re.fullmatch(r"([^\s=!(),]+)\s*(==|=|!=)\s*([^\s=!(),]*)", term):
            key, op, value = m[1], m[2], m[3]
            same = op != "!="
            tests.append(lambda ls, k=key, v=value, s=same: (ls.get(k) == v) == s)
        elif re.fullmatch(r"[^\s=!(),]+", term):
            tests.append(lambda ls, k=term: k in ls)
        else:
            raise failure(400, "BadRequest", f"unable to parse requirement: {term!r}")

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(test(labels) for test in tests)

    return matches


def parse_field_selector(text: str) -> Matcher:
    """Parse a ``fieldSelector`` on ``metadata.name``/``metadata.namespace``; else a 400."""
    tests: list[Matcher] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"metadata\.(name|namespace)\s*(==|=|!=)\s*(\S*)", part)
        if m is None:
            raise failure(400, "BadRequest", f"field label not supported: {part!r}")
        field, same, value = m[1], m[2] != "!=", m[3]
        tests.append(lambda o, f=field, v=value, s=same: (o["metadata"].get(f, "") == v) == s)
    return lambda obj: all(test(obj) for test in tests)


# --- request parsing -----------------------------------------------------------------------


def parse_path(path: str) -> tuple[kmock.resource | None, str | None, str | None, str | None]:
    """Split an API path into (resource, namespace, name, subresource).

    kmock's own parser raises on ``/api/v1/namespaces`` and reads ``/api/v1/namespaces/x`` as
    a namespace; core namespaces are a resource here.
    """
    segments = [s for s in path.strip("/").split("/") if s]
    if segments[:1] == ["api"] and len(segments) >= 2:
        group, version, rest = "", segments[1], segments[2:]
    elif segments[:1] == ["apis"] and len(segments) >= 2:
        group, version, rest = segments[1], (segments[2:3] or [None])[0], segments[3:]
    else:
        return None, None, None, None
    namespace = None
    # /api/v1/namespaces/x[/status] is the Namespace x itself, not a scope.
    a_namespace = group == "" and rest[:1] == ["namespaces"] and rest[2:] in ([], ["status"])
    if rest[:1] == ["namespaces"] and len(rest) >= 3 and not a_namespace:
        namespace, rest = rest[1], rest[2:]
    plural, name = (rest[:1] or [None])[0], (rest[1:2] or [None])[0]
    resource = kmock.resource(group=group, version=version, plural=plural)
    return resource, namespace, name, "/".join(rest[2:]) or None


async def parse_request(raw: aiohttp.web.BaseRequest, *, id: int) -> kmock.Request:
    body = await raw.read()
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    resource, namespace, name, subresource = parse_path(raw.path)
    method = kmock.method(raw.method)
    action = None
    if resource is not None and resource.plural is not None:
        if method == kmock.method.GET and raw.query.get("watch") in ("true", "1"):
            action = kmock.action.WATCH
        elif name is None:
            action = {"GET": kmock.action.LIST, "POST": kmock.action.CREATE}.get(raw.method)
        else:
            by_method = {"GET": "FETCH", "PATCH": "UPDATE", "DELETE": "DELETE"}
            action = kmock.action(by_method[raw.method]) if raw.method in by_method else None
    return kmock.Request(
        id=id,
        raw_request=raw,
        url=raw.url,
        method=raw.method,
        params=dict(raw.query),
        headers=dict(raw.headers),
        cookies=dict(raw.cookies),
        body=body,
        text=body.decode("utf-8", "replace"),
        data=data,
        action=action,
        resource=resource,
        namespace=namespace,
        name=name,
        subresource=subresource,
    )


def body_of(request: kmock.Request, kind: type) -> Any:
    if not isinstance(request.data, kind):
        raise failure(400, "BadRequest", f"the request body must be a JSON {kind.__name__}")
    return copy.deepcopy(request.data)


def check_version(current: dict[str, Any], body: dict[str, Any]) -> None:
    sent = (body.get("metadata") or {}).get("resourceVersion")
    if sent is not None and sent != current["metadata"].get("resourceVersion"):
        raise failure(
            409,
            "Conflict",
            "Operation cannot be fulfilled: the object has been modified;"
            " please apply your changes to the latest version and try again",
            name=current["metadata"].get("name"),
        )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge-patch: dicts merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def spec_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    skipped = ("metadata", "status", "apiVersion", "kind")
    return {key: value for key, value in obj.items() if key not in skipped}


def validate(obj: Mapping[str, Any], *, namespace_name: bool) -> None:
    meta = obj["metadata"]
    name, limit = meta.get("name"), 63 if namespace_name else 253
    pattern = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?") if namespace_name else _NAME
    if not isinstance(name, str) or len(name) > limit or not pattern.fullmatch(name):
        raise failure(422, "Invalid", f"metadata.name: Invalid value: {name!r}: not a DNS name")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label_name = str(key).rpartition("/")
        bad_key = (prefix and not _NAME.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(label_name)
        bad_value = not isinstance(value, str) or (value and not _LABEL_NAME.fullmatch(value))
        if bad_key or bad_value or len(label_name) > 63 or len(str(value)) > 63:
            raise failure(422, "Invalid", f"metadata.labels: Invalid value: {key!r}: {value!r}")
