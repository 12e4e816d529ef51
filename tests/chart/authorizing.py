"""RBAC as the API server applies it, over the chart's rendered Roles and ClusterRoles.

Why it exists: "least privilege" is two claims. The rules must be no more than the table in
``test_rbac.py`` (checked there, rule by rule), and no less than what the operator and the device
plugin really do. The second is checked by recording every request the real operator and the
real device plugin make against the API stand-in during a whole reservation's life, and asking
this module whether the rendered RBAC allows each one.

It reduces an HTTP request to the API server's request attributes (verb, API group, resource,
subresource, namespace, name: ``k8s.io/apiserver``'s RequestInfo) and matches them against
``PolicyRule``s the way the RBAC authorizer does: a ClusterRole bound by a ClusterRoleBinding
applies everywhere, a Role bound by a RoleBinding only in its namespace, ``resourceNames``
only to requests that name an object (never to list, watch or create).

What it must never do: allow what RBAC would not. Discovery (``/api``, ``/apis``, ``/version``)
is allowed to every authenticated user by the default ``system:discovery`` ClusterRole, so it is
allowed here and nothing else without a rule is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DISCOVERY = ("/api", "/apis", "/version", "/openapi")


@dataclass(frozen=True)
class Attributes:
    """A request as RBAC sees it; ``resource`` empty for a non-resource URL."""

    verb: str
    path: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def full_resource(self) -> str:
        return self.resource + (f"/{self.subresource}" if self.subresource else "")

    def __str__(self) -> str:
        if not self.resource:
            return f"{self.verb} {self.path}"
        what = self.resource + (f"/{self.subresource}" if self.subresource else "")
        where = f" in {self.namespace}" if self.namespace else ""
        named = f" {self.name}" if self.name else ""
        return f"{self.verb} {self.group or 'core'}/{what}{named}{where}"


def attributes(method: str, path: str, params: Mapping[str, str]) -> Attributes:
    """``GET /apis/bcd.dev/v1alpha1/namespaces/x/deviceallocations?watch=true`` → watch …"""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return Attributes(verb=method.lower(), path=path)
    if not rest:  # /api/v1, /apis/<group>/<version>: discovery
        return Attributes(verb=method.lower(), path=path)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    verb = {
        "GET": "get" if name else ("watch" if params.get("watch") in ("true", "1") else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method.upper()]
    return Attributes(
        verb=verb,
        path=path,
        group=group,
        resource=resource,
        subresource=subresource,
        namespace=namespace,
        name=name,
    )


def _rule_allows(rule: Mapping[str, Any], request: Attributes) -> bool:
    resource = request.resource + (f"/{request.subresource}" if request.subresource else "")
    if request.verb not in rule.get("verbs", []):
        return False
    if request.group not in rule.get("apiGroups", []):
        return False
    if resource not in rule.get("resources", []):
        return False
    names = rule.get("resourceNames")
    return not names or request.name in names


@dataclass
class Authorizer:
    """The rules one service account holds: cluster-wide ones and per-namespace ones."""

    cluster: list[Mapping[str, Any]]
    namespaced: dict[str, list[Mapping[str, Any]]]

    def allows(self, request: Attributes) -> bool:
        if not request.resource:
            return request.path.startswith(DISCOVERY)
        if any(_rule_allows(rule, request) for rule in self.cluster):
            return True
        if request.namespace:
            rules = self.namespaced.get(request.namespace, [])
            return any(_rule_allows(rule, request) for rule in rules)
        return False


def authorizer_for(
    objects: Iterable[Mapping[str, Any]], *, namespace: str, name: str
) -> Authorizer:
    """What the service account ``namespace``/``name`` may do, from rendered RBAC objects."""
    objects = list(objects)
    roles = {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o.get("rules", [])
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    cluster: list[Mapping[str, Any]] = []
    namespaced: dict[str, list[Mapping[str, Any]]] = {}
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == name and s["namespace"] == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        where = binding["metadata"].get("namespace", "")
        role_ns = where if ref["kind"] == "Role" else ""
        rules = roles[(ref["kind"], role_ns, ref["name"])]
        if binding["kind"] == "ClusterRoleBinding":
            cluster.extend(rules)
        else:
            namespaced.setdefault(where, []).extend(rules)
    return Authorizer(cluster=cluster, namespaced=namespaced)
