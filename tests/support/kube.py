"""A Kubernetes API server stand-in for tests: kmock's emulator plus the semantics kopf needs.

Why it exists: kmock 0.8's ``KubernetesEmulator`` keeps objects and streams watch events, but
it sets no ``resourceVersion``/``uid``/``generation``, mixes spec and status, ignores
selectors, answers a create with 200 and a failed JSON-patch ``test`` with 500 (see
``/work/shared/reference/kmock-notes.md``). The real kopf operator and the device-plugin node
agent run against this subclass over real HTTP, so it answers as a real API server does:

- create: 201 with the stored object; ``uid``, ``creationTimestamp`` (RFC 3339, ``Z``),
  ``generation: 1``; ``metadata.namespace`` from the URL (a body namespace that disagrees is
  400); ``generateName``; a duplicate name is 409 ``AlreadyExists``; names and labels are
  validated (422); ``status`` is dropped for resources with the status subresource.
- ``resourceVersion``: one global counter, bumped by every write that changes something
  (a write that changes nothing is a no-op, as on a real server: no new version, no event).
- ``generation``: bumped when a top-level field other than metadata and status changes.
- PATCH: merge-patch, JSON-patch (a failed ``test`` is 422 ``Invalid``), strategic merge for
  core (group ``""``) resources only (as merge-patch); merge-patch and PUT carrying a stale
  ``metadata.resourceVersion`` are 409 ``Conflict``.
- status subresource: a main write keeps the stored status, a ``/status`` write changes only
  status. Without the subresource, main writes change status and ``/status`` is 404.
- delete: with finalizers, marks ``deletionTimestamp`` (a write); removing the last finalizer
  of a marked object deletes it (MODIFIED then DELETED); without finalizers, gone at once.
- list and watch honour ``labelSelector`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``a``,
  ``!a``, comma-AND) and ``fieldSelector`` on ``metadata.name``/``metadata.namespace``; a
  watch sends ADDED/DELETED when an object starts/stops matching; ``resourceVersion=N``
  replays only changes after N; ``timeoutSeconds`` ends the stream; ``sendInitialEvents``
  ends its initial ADDED events with the ``k8s.io/initial-events-end`` bookmark.
- ``POST /apis/authentication.k8s.io/v1/tokenreviews`` answers from ``tokens``.
- ``certificates.k8s.io/v1`` CertificateSigningRequests with their ``/approval`` and
  ``/status`` subresources: the requester (``spec.username``, ``uid``, ``groups``, ``extra``)
  from the caller's token, and the rules of ``tests/support/csrs.py``.
- admission on create and update (incl. ``/status``): mutating webhooks, the CRD's schema and
  CEL rules, validating webhooks, as ``tests/support/admission.py`` describes; webhook
  configurations are ``admissionregistration.k8s.io/v1`` objects created through the API, and
  ``webhook_services`` maps a webhook's Service to a URL. ``put_raw`` stores past admission.

- every Namespace carries ``kubernetes.io/metadata.name: <its name>``, set after the mutating
  webhooks on create and update, as the API server's namespace strategy does (webhook
  ``namespaceSelector``s name namespaces by it).

Not done (real servers do): namespaces are not required to exist and are not cascaded on
delete; no ``410 Gone`` unless a test calls ``compact``
(the change log is otherwise never compacted), no server-side apply, no delete preconditions
or collections; PUT without a ``resourceVersion`` is accepted unconditionally.

The pure rules (selectors, merge-patch, validation, ``Ref``) live in ``kubeobjects.py``; this
module holds the state and the HTTP dispatch. Who calls it: ``tests/support/kubeserver.py``
(the fixture) and tests that look past HTTP (``stored``, ``tokens``, ``declare_crd``).
What it must never do: reach beyond loopback, persist anything, or import ``bettercompute``:
it stands in for Kubernetes, so our code must not shape it.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import rendering  # StreamingError and Response, as kmock dispatches

from tests.support import admission, csrs, kubeobjects
from tests.support.kubeobjects import (
    ALL_VERBS,
    CLUSTER_KOPF_PEERINGS,
    DEVICEALLOCATIONS,
    EVENTS,
    GPUNODES,
    GPUPOOLS,
    KOPF_PEERINGS,
    NAMESPACES,
    RESERVATIONS,
    SECRETS,
    SERVICE_ACCOUNTS,
    TOKEN_REVIEWS,
    Matcher,
    Ref,
)

__all__ = [
    "CLUSTER_KOPF_PEERINGS",
    "DEVICEALLOCATIONS",
    "EVENTS",
    "GPUNODES",
    "GPUPOOLS",
    "KOPF_PEERINGS",
    "NAMESPACES",
    "NAMESPACE_NAME_LABEL",
    "RESERVATIONS",
    "SECRETS",
    "SERVICE_ACCOUNTS",
    "TOKEN_REVIEWS",
    "ApiServerStandIn",
    "Ref",
]


# --- the stand-in --------------------------------------------------------------------------


#: The label the API server puts on every Namespace: its own name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

# libyaml when present: the project's CRDs parse in 6 ms instead of 50 ms, once per test.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclasses.dataclass(frozen=True)
class _Change:
    """One committed write, kept for watches that resume from a resourceVersion."""

    revision: int
    resource: kmock.resource
    namespace: str | None
    name: str
    type: str
    obj: dict[str, Any]
    previous: dict[str, Any] | None


@attrs.define(kw_only=True)
class ApiServerStandIn(kmock.KubernetesEmulator):
    """kmock's emulator with the API-server semantics of the module docstring."""

    # token -> {"username": ..., "uid": ..., "groups": [...]}, answered by TokenReview.
    tokens: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    #: Keep only this many served requests (None: all). kmock matches every request against
    #: its whole request history, so a long-running benchmark bounds it to stay linear.
    request_history: int | None = None
    _served: int = attrs.field(default=0, init=False)
    _revision: int = attrs.field(default=0, init=False)
    _changes: list[_Change] = attrs.field(factory=list, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _written: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _admission: admission.Admission = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._admission = admission.Admission(
            objects_of=lambda ref: self._snapshot(ref.resource, None, lambda _: True),
            stored=self.stored,
        )
        for webhooks, kind in (
            (admission.MUTATING_WEBHOOKS, "MutatingWebhookConfiguration"),
            (admission.VALIDATING_WEBHOOKS, "ValidatingWebhookConfiguration"),
        ):
            self.declare(webhooks, kind=kind)
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.declare(NAMESPACES, kind="Namespace", short_names=["ns"], status_subresource=True)
        self.declare(EVENTS, kind="Event", short_names=["ev"])
        self.declare(SECRETS, kind="Secret")
        self.declare(SERVICE_ACCOUNTS, kind="ServiceAccount", short_names=["sa"])
        self.declare(CLUSTER_KOPF_PEERINGS, kind="ClusterKopfPeering")
        self.declare(KOPF_PEERINGS, kind="KopfPeering")
        self.declare(TOKEN_REVIEWS, kind="TokenReview", verbs=["create"])
        self.declare(csrs.CSRS, kind="CertificateSigningRequest", short_names=["csr"])
        self.resources[csrs.CSRS.resource].subresources = {"status", "approval"}

    # --- declaring resources

    def declare(
        self,
        ref: Ref,
        *,
        kind: str,
        singular: str | None = None,
        short_names: list[str] | tuple[str, ...] = (),
        categories: list[str] | tuple[str, ...] = (),
        status_subresource: bool = False,
        verbs: list[str] | tuple[str, ...] = ALL_VERBS,
    ) -> None:
        self.resources[ref.resource] = kmock.ResourceInfo(
            namespaced=ref.namespaced,
            kind=kind,
            singular=singular or kind.lower(),
            verbs=verbs,
            shortnames=short_names,
            categories=categories,
            subresources={"status"} if status_subresource else set(),
        )

    def declare_crd(self, crd: Mapping[str, Any]) -> list[Ref]:
        """Declare every served version of a CustomResourceDefinition manifest."""
        where = f"CRD {crd.get('metadata', {}).get('name', '?')!r}"
        if crd.get("kind") != "CustomResourceDefinition":
            raise ValueError(f"{where}: kind must be CustomResourceDefinition: {crd.get('kind')!r}")

        def need(parent: Mapping[str, Any], path: str, kind: type) -> Any:
            value = parent.get(path.rsplit(".", 1)[-1])
            if not isinstance(value, kind) or not value:
                raise ValueError(f"{where}: {path} must be a non-empty {kind.__name__}: {value!r}")
            return value

        spec = need(crd, "spec", dict)
        names = need(spec, "spec.names", dict)
        scope = need(spec, "spec.scope", str)
        if scope not in ("Namespaced", "Cluster"):
            raise ValueError(f"{where}: spec.scope must be Namespaced or Cluster: {scope!r}")
        refs = []
        for version in need(spec, "spec.versions", list):
            if not version.get("served", False):
                continue
            ref = Ref(
                group=need(spec, "spec.group", str),
                version=need(version, "spec.versions[].name", str),
                plural=need(names, "spec.names.plural", str),
                namespaced=scope == "Namespaced",
            )
            self.declare(
                ref,
                kind=need(names, "spec.names.kind", str),
                singular=names.get("singular"),
                short_names=names.get("shortNames", ()),
                categories=names.get("categories", ()),
                status_subresource="status" in (version.get("subresources") or {}),
            )
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if schema is not None:
                self._admission.schemas[ref.resource] = schema
            refs.append(ref)
        if not refs:
            raise ValueError(f"{where}: spec.versions has no served version")
        return refs

    def declare_crds(self, directory: Path) -> list[Ref]:
        """Declare the CRDs of every ``*.yaml`` in ``directory``; anything else is an error."""
        files = sorted(directory.glob("*.yaml"))
        if not files:
            raise ValueError(f"{directory}: no *.yaml files to declare CRDs from")
        refs = []
        for path in files:
            loaded = yaml.load_all(path.read_text(), Loader=_YAML_LOADER)
            docs = [doc for doc in loaded if doc is not None]
            if not docs:
                raise ValueError(f"{path}: no YAML document in the file")
            for doc in docs:
                try:
                    if not isinstance(doc, dict):
                        raise ValueError(f"a document is not a mapping: {doc!r}")
                    refs += self.declare_crd(doc)
                except ValueError as e:
                    raise ValueError(f"{path}: {e}") from e
        return refs

    def ref_for(self, *, api_version: str, kind: str) -> Ref:
        """The declared resource of an object's ``apiVersion`` and ``kind``."""
        for resource in self.resources:
            info = self.resources[resource]
            ref = Ref(
                group=resource.group or "",
                version=resource.version or "",
                plural=resource.plural or "",
                namespaced=bool(info.namespaced),
            )
            if info.kind == kind and ref.api_version == api_version:
                return ref
        raise LookupError(f"no resource declared for apiVersion={api_version!r} kind={kind!r}")

    @property
    def webhook_services(self) -> dict[tuple[str, str], str]:
        """Where a webhook's ``clientConfig.service`` is: ``[(namespace, name)] = base URL``."""
        return self._admission.services

    # --- reading the state past HTTP

    @property
    def revision(self) -> int:
        """The latest resourceVersion handed out (0 before the first write)."""
        return self._revision

    def stored(self, ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
        """A copy of the stored object, or None when absent or deleted."""
        current = self._current((ref.resource, namespace if ref.namespaced else None, name))
        return copy.deepcopy(current)

    def compact(self) -> None:
        """Forget the change history up to now, as etcd compaction does: a watch from an older
        ``resourceVersion`` is answered ``410 Gone`` and must list again."""
        self._compacted = self._revision

    def put_raw(self, ref: Ref, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (create or replace) past admission, the CRD's schema and the status
        split, as one write with a new resourceVersion and a watch event.

        The back door for a test that needs an object a real cluster would refuse today: one
        written under an older CRD, say. Use it only to set up such a test, with a comment
        saying why; everything else goes through HTTP.
        """
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (ref.resource, meta.get("namespace") if ref.namespaced else None, meta["name"])
        current = self._current(key)
        if current is None:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=kubeobjects.now(), generation=1)
            return self._commit(key, "ADDED", obj)
        for field in ("uid", "creationTimestamp", "generation"):
            meta[field] = current["metadata"].get(field)
        return self._commit(key, "MODIFIED", obj)

    async def written(self, *, since: int) -> None:
        """Return once some write has committed a resourceVersion above ``since``."""
        while self._revision <= since:
            await self._written.wait()

    # --- HTTP dispatch

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's RawHandler.__call__ with our own path parser (kmock's cannot read core
        # namespaces); errors are still collected in ``errors`` and rendered as Status bodies.
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            request = await kubeobjects.parse_request(raw_request, id=self._served)
            self._served += 1
            self._requests.append(request)
            if self.request_history is not None and len(self._requests) > self.request_history:
                del self._requests[: -self.request_history]
            try:
                return await self._handle(request)
            except rendering.StreamingError as e:
                raw_response = e.args[0]
                raise e.__cause__ or e from None
        except Exception as e:
            if not self._errors:
                raise
            self._errors[-1].append(e)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: writes happen in the _serve_* reactions below, so a
        # reaction a test puts in front (``emulator["patch"] << 500``) stores nothing.
        return await kmock.RawHandler._handle(self, request)

    def _target(self, request: kmock.Request) -> tuple[kmock.resource, kmock.ResourceInfo]:
        resource = request.resource
        if resource is None or resource.plural is None or resource not in self.resources:
            raise kubeobjects.not_found()
        info = self.resources[resource]
        wrong_scope = request.namespace is not None and not info.namespaced
        if wrong_scope or request.subresource not in (None, *info.subresources):
            raise kubeobjects.not_found()
        return resource, info

    def _key(self, request: kmock.Request) -> tuple[kmock.resource, str | None, str]:
        resource, info = self._target(request)
        if request.name is None or (info.namespaced and request.namespace is None):
            raise kubeobjects.not_found()
        return resource, request.namespace, request.name

    def _current(self, key: tuple[kmock.resource, str | None, str]) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _existing(self, request: kmock.Request) -> dict[str, Any]:
        resource, _, name = key = self._key(request)
        current = self._current(key)
        if current is None:
            what = f"{resource.plural}.{resource.group}".rstrip(".")
            raise kubeobjects.failure(404, "NotFound", f'{what} "{name}" not found', name=name)
        return current

    # --- reads

    async def _serve_fetch(self, request: kmock.Request) -> rendering.Payload:
        return self._existing(request)

    async def _serve_list(self, request: kmock.Request) -> rendering.Payload:
        resource, info = self._target(request)
        matches = self._selection(request)
        return {
            "apiVersion": kubeobjects.api_version_of(resource),
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self._revision)},
            "items": self._snapshot(resource, request.namespace, matches),
        }

    def _selection(self, request: kmock.Request) -> Matcher:
        labels = kubeobjects.parse_label_selector(request.params.get("labelSelector", ""))
        fields = kubeobjects.parse_field_selector(request.params.get("fieldSelector", ""))
        name = request.name  # a watch on one object: /…/plural/name?watch=true

        def matches(obj: Mapping[str, Any]) -> bool:
            named = name is None or obj["metadata"].get("name") == name
            return named and labels(obj) and fields(obj)

        return matches

    def _snapshot(
        self, resource: kmock.resource, namespace: str | None, matches: Matcher
    ) -> list[dict[str, Any]]:
        found = [
            (key[1] or "", key[2], obj.raw)
            for key, obj in self.objects.items()
            if key[0] == resource and namespace in (None, key[1]) and not obj.deleted
        ]
        return [raw for _, _, raw in sorted(found, key=lambda f: f[:2]) if matches(raw)]

    async def _serve_watch(self, request: kmock.Request) -> rendering.Payload:
        # Validated before streaming starts, so bad parameters are a plain 400, not a stream.
        resource, info = self._target(request)
        matches = self._selection(request)
        since, timeout = request.params.get("resourceVersion"), request.params.get("timeoutSeconds")
        if not (since or "0").isdigit() or not (timeout or "0").isdigit():
            raise kubeobjects.failure(
                400, "BadRequest", "resourceVersion and timeoutSeconds must be integers"
            )
        if since not in (None, "", "0") and int(since) < self._compacted:
            raise kubeobjects.failure(
                410, "Expired", f"too old resource version: {since} ({self._compacted})"
            )
        initial: list[dict[str, Any]] = []
        if since in (None, "", "0"):
            initial = self._snapshot(resource, request.namespace, matches)
            position = len(self._changes)
        else:
            position = bisect.bisect_right([c.revision for c in self._changes], int(since))
        deadline = None if timeout is None else asyncio.get_running_loop().time() + int(timeout)
        bookmark = None
        if request.params.get("sendInitialEvents") == "true":
            meta = {"resourceVersion": str(self._revision)}
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}  # type: ignore[assignment]
            bookmark = {"kind": info.kind, "metadata": meta}
        return self._stream_changes(
            request, resource, matches, initial, bookmark, position, deadline
        )

    async def _stream_changes(
        self,
        request: kmock.Request,
        resource: kmock.resource,
        matches: Matcher,
        initial: list[dict[str, Any]],
        bookmark: dict[str, Any] | None,
        position: int,
        deadline: float | None,
    ) -> AsyncIterator[rendering.Payload]:
        yield b""  # sends the headers now: a client waits for them before any event arrives
        for obj in initial:
            yield {"type": "ADDED", "object": obj}
        if bookmark is not None:
            yield {"type": "BOOKMARK", "object": bookmark}
        while True:
            while position < len(self._changes):
                change = self._changes[position]
                position += 1
                if change.resource == resource and request.namespace in (None, change.namespace):
                    event_type = _seen_as(change, matches)
                    if event_type is not None:
                        yield {"type": event_type, "object": change.obj}
            try:
                async with asyncio.timeout_at(deadline):  # never across a yield
                    await self._written.wait()
            except TimeoutError:
                return

    # --- writes

    def _commit(
        self, key: tuple[kmock.resource, str | None, str], event_type: str, obj: dict[str, Any]
    ) -> dict[str, Any]:
        previous = self._current(key)
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        if key not in self.objects:
            self.objects[key] = obj
        else:
            self.objects[key].history.append(obj)
        if event_type == "DELETED":
            self.objects[key].delete()
        self._changes.append(_Change(self._revision, *key, event_type, obj, previous))
        self._written.set()
        self._written = asyncio.Event()
        return obj

    async def _serve_create(self, request: kmock.Request) -> rendering.Payload:
        resource, info = self._target(request)
        if request.subresource is not None:
            raise kubeobjects.not_found()
        obj = kubeobjects.body_of(request, dict)
        if resource == TOKEN_REVIEWS.resource:
            return rendering.Response(status=201, payload=self._review(obj))
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise kubeobjects.failure(400, "BadRequest", "metadata must be a JSON object")
        for field, expected in (
            ("apiVersion", kubeobjects.api_version_of(resource)),
            ("kind", info.kind),
        ):
            if obj.setdefault(field, expected) != expected:
                raise kubeobjects.failure(
                    400, "BadRequest", f"{field} {obj[field]!r} is not {expected!r}"
                )
        if info.namespaced:
            if request.namespace is None:
                raise kubeobjects.failure(
                    400, "BadRequest", "a namespaced object needs a namespace URL"
                )
            if meta.setdefault("namespace", request.namespace) != request.namespace:
                message = "the namespace of the provided object does not match the namespace"
                raise kubeobjects.failure(400, "BadRequest", f"{message} sent on the request")
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        chain = self._chain(request, "CREATE", str(meta.get("name") or ""))
        if resource == csrs.CSRS.resource:
            csrs.prepare_create(obj, chain.write.user)
        obj = await chain.mutate(obj, None)
        meta = obj["metadata"]
        kubeobjects.validate(obj, namespace_name=resource == NAMESPACES.resource)
        if resource == NAMESPACES.resource:
            meta["labels"] = {**(meta.get("labels") or {}), NAMESPACE_NAME_LABEL: meta["name"]}
        key = (resource, meta.get("namespace"), meta["name"])
        if self._current(key) is not None:
            what = f"{resource.plural}.{resource.group}".rstrip(".")
            message = f'{what} "{meta["name"]}" already exists'
            raise kubeobjects.failure(
                409, "AlreadyExists", message, name=meta["name"], kind=resource.plural
            )
        for field in (*kubeobjects.SERVER_FIELDS, *kubeobjects.DELETION_FIELDS):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=kubeobjects.now(), generation=1)
        if "status" in info.subresources:
            obj.pop("status", None)
        obj = await chain.validate(obj, None)
        committed = self._commit(key, "ADDED", obj)
        return rendering.Response(status=201, payload=committed, headers=chain.headers)

    async def _serve_update(self, request: kmock.Request) -> rendering.Payload:
        current = self._existing(request)
        headers = {key.lower(): value for key, value in request.headers.items()}
        content_type = headers.get("content-type", "").split(";")[0].strip()
        strategic = content_type == "application/strategic-merge-patch+json"
        if content_type == "application/json-patch+json":
            try:
                candidate = jsonpatch.apply_patch(current, kubeobjects.body_of(request, list))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise kubeobjects.failure(
                    422, "Invalid", f"the JSON patch does not apply: {e}"
                ) from e
        elif content_type == "application/merge-patch+json" or (
            strategic and request.resource is not None and request.resource.group == ""
        ):
            patch = kubeobjects.body_of(request, dict)
            kubeobjects.check_version(current, patch)
            candidate = kubeobjects.merge_patch(current, patch)
        else:
            raise kubeobjects.failure(
                415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
            )
        return await self._update(request, current, candidate)

    async def _serve_replace(self, request: kmock.Request) -> rendering.Payload:
        current = self._existing(request)
        candidate = kubeobjects.body_of(request, dict)
        if candidate.get("metadata", {}).get("name", request.name) != request.name:
            raise kubeobjects.failure(
                400, "BadRequest", "the name of the object does not match the URL"
            )
        kubeobjects.check_version(current, candidate)
        return await self._update(request, current, candidate)

    def _chain(self, request: kmock.Request, operation: str, name: str) -> admission.Chain:
        _, info = self._target(request)
        write = admission.write_of(
            request,
            kind=info.kind,
            namespaced=bool(info.namespaced),
            operation=operation,
            name=name,
            tokens=self.tokens,
        )
        return self._admission.chain(write)

    async def _update(
        self, request: kmock.Request, current: dict[str, Any], candidate: Any
    ) -> rendering.Payload:
        key = self._key(request)
        has_status = "status" in self.resources[key[0]].subresources
        if not isinstance(candidate, dict) or not isinstance(candidate.get("metadata", {}), dict):
            raise kubeobjects.failure(
                422, "Invalid", "the object and its metadata must be JSON objects"
            )
        chain = self._chain(request, "UPDATE", key[2])
        candidate = await chain.mutate(candidate, current)
        if request.subresource in ("status", "approval"):
            result = copy.deepcopy(current)
            result.pop("status", None)
            if candidate.get("status") is not None:
                result["status"] = copy.deepcopy(candidate["status"])
        else:
            result = copy.deepcopy(candidate)
            meta, old_meta = result.setdefault("metadata", {}), current["metadata"]
            for field in (
                "name",
                "namespace",
                *kubeobjects.SERVER_FIELDS,
                *kubeobjects.DELETION_FIELDS,
            ):
                meta.pop(field, None)
                if field in old_meta:
                    meta[field] = old_meta[field]
            result["apiVersion"], result["kind"] = current["apiVersion"], current["kind"]
            if has_status:
                result.pop("status", None)
                if "status" in current:
                    result["status"] = current["status"]
            if kubeobjects.spec_of(result) != kubeobjects.spec_of(current):
                meta["generation"] = old_meta.get("generation", 0) + 1
            kubeobjects.validate(result, namespace_name=False)
            if key[0] == NAMESPACES.resource:
                meta["labels"] = {**(meta.get("labels") or {}), NAMESPACE_NAME_LABEL: key[2]}
            added = set(meta.get("finalizers") or ()) - set(old_meta.get("finalizers") or ())
            if old_meta.get("deletionTimestamp") and added:
                raise kubeobjects.failure(
                    422,
                    "Invalid",
                    "metadata.finalizers: Forbidden: no new finalizers"
                    " can be added if the object is being deleted",
                )
        if key[0] == csrs.CSRS.resource:
            result = csrs.settle_update(request.subresource, current, result)
        result = await chain.validate(result, current)
        if result == current:
            return rendering.Response(status=200, payload=current, headers=chain.headers)
        obj = self._commit(key, "MODIFIED", result)
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            obj = self._commit(key, "DELETED", copy.deepcopy(obj))
        return rendering.Response(status=200, payload=obj, headers=chain.headers)

    async def _serve_delete(self, request: kmock.Request) -> rendering.Payload:
        current = self._existing(request)
        key = self._key(request)
        if current["metadata"].get("deletionTimestamp"):
            return rendering.Response(status=202, payload=current)
        obj = copy.deepcopy(current)
        if obj["metadata"].get("finalizers"):
            obj["metadata"].update(
                deletionTimestamp=kubeobjects.now(), deletionGracePeriodSeconds=0
            )
            return rendering.Response(status=202, payload=self._commit(key, "MODIFIED", obj))
        return rendering.Response(status=200, payload=self._commit(key, "DELETED", obj))

    def _review(self, review: dict[str, Any]) -> dict[str, Any]:
        spec = review.get("spec") or {}
        user = self.tokens.get(spec.get("token", ""))
        status: dict[str, Any] = {"authenticated": False}
        if user is not None:
            status = {"authenticated": True, "user": copy.deepcopy(user)}
            status["audiences"] = spec.get("audiences") or []
        return {
            "apiVersion": TOKEN_REVIEWS.api_version,
            "kind": "TokenReview",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }


def _seen_as(change: _Change, matches: Matcher) -> str | None:
    """The event type a selective watch sees for a change, or None when it sees nothing."""
    now = matches(change.obj)
    before = change.previous is not None and matches(change.previous)
    if change.type != "MODIFIED":
        return change.type if now else None
    return {(True, True): "MODIFIED", (True, False): "ADDED", (False, True): "DELETED"}.get(
        (now, before)
    )
