"""The API server's admission chain for the stand-in: webhooks, then the CRD's schema and rules.

Why it exists: a real API server runs every create and update through admission before it
stores anything, and our security guarantees (who a Reservation is stamped for, which pod may
take a reservation's devices) hold only because it does. Tests that let the stand-in store
whatever a client sends would show nothing, so ``tests/support/kube.py`` calls this module on
every create and update (patch and PUT, and ``/status`` writes), in the API server's order:

1. mutating webhooks of the stored ``MutatingWebhookConfiguration`` objects (by name, then in
   order), each called over HTTP(S) with an ``admission.k8s.io/v1`` ``AdmissionReview`` and
   its ``JSONPatch`` applied;
2. the custom resource's OpenAPI v3 schema and ``x-kubernetes-validations`` CEL rules, as
   ``tests/support/crdchecking.py`` checks them: an error is ``422 Invalid`` with
   ``status.details.causes``; a pruned unknown field is a ``Warning`` header, or ``400`` with
   ``?fieldValidation=Strict``. A ``/status`` write checks ``status`` only;
3. validating webhooks of the stored ``ValidatingWebhookConfiguration`` objects.

A webhook is called when one of its ``rules`` names the operation, group, version, resource
(``reservations``, ``pods/status``, ``*``, ``*/*``, ``*/status``) and scope, its
``namespaceSelector`` matches the labels of the object's Namespace (a Namespace matches on its
own labels; other cluster-scoped objects always match), its ``objectSelector`` matches the old
or the new object's labels, and all its ``matchConditions`` (CEL over ``object``,
``oldObject`` and ``request``) are true. A webhook that cannot be reached, answers badly, runs
out of its ``timeoutSeconds`` or whose condition fails to evaluate refuses the write with
``500 failed calling webhook "<name>": …`` under ``failurePolicy: Fail`` (the default) and is
skipped under ``Ignore``. A refusal is answered as the API server does: the webhook's code (400
at least) and ``admission webhook "<name>" denied the request: <message>``. Webhook warnings
come back as ``Warning: 299 - "<text>"`` headers (joined in one header, comma-separated).

The caller (``request.userInfo``) is the ``tokens`` entry of the request's bearer token;
a token the table does not hold is ``STAND_IN_ADMIN`` (the stand-in authorizes every caller,
as a cluster admin's kubeconfig would be), no token at all is ``system:anonymous``.
``clientConfig.url`` is called as given (plain ``http://`` is accepted on loopback, where a
real server demands HTTPS); a ``clientConfig.service`` is resolved through ``services``, which
the test fills: ``services[(namespace, name)] = "http://127.0.0.1:<port>"`` (the service's
``path`` is appended, its ``port`` is the test's business). ``caBundle`` verifies HTTPS.

Left out, as tests here do not need them: DELETE and CONNECT admission, ``authorizer`` in
``matchConditions`` (a condition naming it fails to evaluate), ``reinvocationPolicy:
IfNeeded``, ``matchPolicy: Equivalent`` conversion between versions (rules must name the
version written), and what ``crdchecking`` leaves out.

What it must never do: reach beyond the URLs a test registered, import ``bettercompute``
(it stands in for Kubernetes), or store anything: the stand-in commits what it returns.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import ssl
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import jsonpatch
import kmock

from tests.support import crdchecking, kubeobjects
from tests.support.kubeobjects import Ref

MUTATING_WEBHOOKS = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="mutatingwebhookconfigurations",
    namespaced=False,
)
VALIDATING_WEBHOOKS = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="validatingwebhookconfigurations",
    namespaced=False,
)
#: Who a token the ``tokens`` table does not know is (see the module docstring).
STAND_IN_ADMIN = {
    "username": "stand-in-admin",
    "uid": "stand-in-admin",
    "groups": ["system:masters", "system:authenticated"],
}
ANONYMOUS = {"username": "system:anonymous", "groups": ["system:unauthenticated"]}

_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 422: "Invalid"}


@dataclasses.dataclass(frozen=True)
class Write:
    """What one request writes, as admission sees it."""

    resource: kmock.resource
    kind: str
    namespaced: bool
    subresource: str | None
    operation: str  # CREATE or UPDATE
    namespace: str | None
    name: str
    user: dict[str, Any]
    dry_run: bool
    options_kind: str  # CreateOptions, UpdateOptions or PatchOptions
    field_validation: str  # Strict, Warn or Ignore


@dataclasses.dataclass
class Admission:
    """The chain's configuration: how to read the stand-in's objects, the test's services and
    the CRD schemas the stand-in declared (by resource)."""

    #: All stored objects of a resource (cluster-wide), newest state.
    objects_of: Callable[[Ref], list[dict[str, Any]]]
    #: The stored object, or None.
    stored: Callable[[Ref, str | None, str], dict[str, Any] | None]
    #: (namespace, name) of a Service → the base URL its webhook listens on.
    services: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    #: A CRD version's openAPIV3Schema, by the resource it serves.
    schemas: dict[kmock.resource, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def chain(self, write: Write) -> Chain:
        return Chain(self, write)


class Chain:
    """One write's pass through admission; collects the warnings for the response headers."""

    def __init__(self, admission: Admission, write: Write) -> None:
        self.admission = admission
        self.write = write
        self.warnings: list[str] = []

    @property
    def headers(self) -> dict[str, str]:
        """The ``Warning`` header of the response (none when there is nothing to say)."""
        if not self.warnings:
            return {}
        return {"Warning": ", ".join(f"299 - {json.dumps(text)}" for text in self.warnings)}

    async def mutate(self, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """``obj`` after every matching mutating webhook's patch."""
        for hook in self._hooks(MUTATING_WEBHOOKS):
            # Matched against the object as the earlier webhooks left it, as the API server does.
            if not self._matches(hook, obj, old):
                continue
            response = await self._call(hook, obj, old)
            if response is None:
                continue
            patch = response.get("patch")
            if patch is None:
                continue
            if response.get("patchType") != "JSONPatch":
                raise _calling_failed(hook, f"unsupported patchType {response.get('patchType')!r}")
            try:
                ops = json.loads(base64.b64decode(patch))
                obj = jsonpatch.apply_patch(obj, ops)
            except (ValueError, jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                # The API server applies a webhook's patch regardless of failurePolicy.
                raise kubeobjects.failure(
                    500, "InternalError", f"Internal error occurred: {_failed(hook, e)}"
                ) from e
            if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
                raise _calling_failed(hook, "the patched object is not a JSON object")
        return obj

    async def validate(self, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """``obj`` pruned as its CRD's schema says, once schema, rules and validating webhooks
        have let it through; raises the API server's refusal otherwise."""
        schema = self.admission.schemas.get(self.write.resource)
        if schema is not None:
            obj = self._check_schema(obj, old, schema)
        for hook in [h for h in self._hooks(VALIDATING_WEBHOOKS) if self._matches(h, obj, old)]:
            await self._call(hook, obj, old)
        return obj

    # --- the CRD's schema and rules

    def _check_schema(
        self, obj: dict[str, Any], old: dict[str, Any] | None, schema: dict[str, Any]
    ) -> dict[str, Any]:
        write = self.write
        result = crdchecking.check(
            obj,
            old if write.operation == "UPDATE" else None,
            schema,
            status_only=write.subresource == "status",
        )
        if result.pruned and write.field_validation == "Strict":
            message = ", ".join(f'unknown field "{path}"' for path in result.pruned)
            raise kubeobjects.failure(400, "BadRequest", f"strict decoding error: {message}")
        if write.field_validation != "Ignore":
            self.warnings += [f'unknown field "{path}"' for path in result.pruned]
        if result.errors:
            raise self._invalid(result.errors)
        return result.obj

    def _invalid(self, errors: list[crdchecking.FieldError]) -> kmock.KubernetesError:
        group = self.write.resource.group
        what = f"{self.write.kind}.{group}" if group else self.write.kind
        shown = [f"{e.path}: {e.message}" for e in errors]
        listed = shown[0] if len(shown) == 1 else f"[{', '.join(shown)}]"
        return kubeobjects.failure(
            422,
            "Invalid",
            f'{what} "{self.write.name}" is invalid: {listed}',
            name=self.write.name,
            group=group,
            kind=self.write.kind,
            causes=[{"reason": e.reason, "message": e.message, "field": e.path} for e in errors],
        )

    # --- webhooks

    def _hooks(self, ref: Ref) -> list[dict[str, Any]]:
        """The webhooks of every configuration of ``ref``'s kind, in the order they run."""
        if self.write.resource in (MUTATING_WEBHOOKS.resource, VALIDATING_WEBHOOKS.resource):
            return []  # the API server never calls webhooks about webhook configurations
        configurations = sorted(self.admission.objects_of(ref), key=lambda c: c["metadata"]["name"])
        return [hook for c in configurations for hook in c.get("webhooks") or []]

    def _matches(
        self, hook: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None
    ) -> bool:
        write = self.write
        if not any(_rule_matches(rule, write) for rule in hook.get("rules") or []):
            return False
        if write.resource == kubeobjects.NAMESPACES.resource:
            namespace_labels = _labels(obj)
        elif write.namespaced:
            namespace = self.admission.stored(kubeobjects.NAMESPACES, None, write.namespace or "")
            namespace_labels = _labels(namespace)
        else:
            namespace_labels = None  # cluster-scoped: namespaceSelector does not apply
        if namespace_labels is not None and not _selects(
            hook.get("namespaceSelector"), namespace_labels
        ):
            return False
        object_selector = hook.get("objectSelector")
        if not (
            _selects(object_selector, _labels(obj))
            or (old is not None and _selects(object_selector, _labels(old)))
        ):
            return False
        return self._conditions_hold(hook, obj, old)

    def _conditions_hold(
        self, hook: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None
    ) -> bool:
        activation = {"object": obj, "oldObject": old, "request": self._request(obj, old)}
        for condition in hook.get("matchConditions") or []:
            try:
                result = crdchecking.evaluate(condition["expression"], activation)
                if not isinstance(result, bool):
                    raise TypeError(f"the expression gave {result!r}, not a bool")
            except Exception as e:
                if hook.get("failurePolicy", "Fail") == "Ignore":
                    return False
                reason = f"failed evaluating match condition {condition.get('name')!r}: {e}"
                raise _calling_failed(hook, reason) from e
            if not result:
                return False
        return True

    def _request(self, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        write = self.write
        group = write.resource.group or ""
        version = write.resource.version or ""
        kind = {"group": group, "version": version, "kind": write.kind}
        resource = {"group": group, "version": version, "resource": write.resource.plural}
        request: dict[str, Any] = {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": write.name,
            "operation": write.operation,
            "userInfo": copy.deepcopy(write.user),
            "object": obj,
            "oldObject": old,
            "dryRun": write.dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": write.options_kind},
        }
        if write.subresource:
            request["subResource"] = request["requestSubResource"] = write.subresource
        if write.namespace is not None:
            request["namespace"] = write.namespace
        return request

    async def _call(
        self, hook: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The webhook's ``response``, or None when it failed under ``failurePolicy: Ignore``.
        A refusal raises the API server's answer."""
        request = self._request(obj, old)
        try:
            response = await self._post(hook, request)
        except _CallFailed as e:
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return None
            raise _calling_failed(hook, str(e)) from e
        self.warnings += [str(w) for w in response.get("warnings") or []]
        if response.get("allowed") is True:
            return response
        status = response.get("status") or {}
        code = status.get("code") if isinstance(status.get("code"), int) else 0
        message = status.get("message") or ""
        denied = f'admission webhook "{hook.get("name")}" denied the request'
        text = f"{denied}: {message}" if message else f"{denied} without explanation"
        code = max(code, 400)  # as the API server: a refusal is never a success code
        reason = status.get("reason") or _REASONS.get(code, "")
        raise kubeobjects.failure(code, reason, text, **(status.get("details") or {}))

    async def _post(self, hook: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        url, verify = self._target(hook)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        timeout = float(hook.get("timeoutSeconds", 10))
        try:
            async with httpx.AsyncClient(timeout=timeout, verify=verify) as client:
                answer = await client.post(url, json={**review, "request": request})
        except httpx.TimeoutException as e:
            raise _CallFailed(
                f'failed to call webhook: Post "{url}": context deadline exceeded'
            ) from e
        except httpx.HTTPError as e:
            raise _CallFailed(f'failed to call webhook: Post "{url}": {e!r}') from e
        if answer.status_code != 200:
            raise _CallFailed(f"received invalid webhook response: HTTP {answer.status_code}")
        try:
            body = answer.json()
        except ValueError as e:
            raise _CallFailed(f"received invalid webhook response: {e}") from e
        response = body.get("response") if isinstance(body, dict) else None
        if body.get("apiVersion") != "admission.k8s.io/v1" or body.get("kind") != (
            "AdmissionReview"
        ):
            raise _CallFailed("received invalid webhook response: not an AdmissionReview v1")
        if not isinstance(response, dict) or not isinstance(response.get("allowed"), bool):
            raise _CallFailed("received invalid webhook response: no response.allowed")
        if response.get("uid") != request["uid"]:
            raise _CallFailed(
                f"expected response.uid={request['uid']!r}, got {response.get('uid')!r}"
            )
        return response

    def _target(self, hook: dict[str, Any]) -> tuple[str, ssl.SSLContext | bool]:
        config = hook.get("clientConfig") or {}
        if "url" in config:
            url = str(config["url"])
        else:
            service = config.get("service") or {}
            key = (str(service.get("namespace")), str(service.get("name")))
            base = self.admission.services.get(key)
            if base is None:
                raise _CallFailed(f"service {key[0]}/{key[1]} is not registered with the stand-in")
            url = base.rstrip("/") + str(service.get("path") or "")
        if not url.startswith("https://"):
            return url, False
        context = ssl.create_default_context()
        if config.get("caBundle"):
            context = ssl.create_default_context(
                cadata=base64.b64decode(config["caBundle"]).decode()
            )
        return url, context


class _CallFailed(Exception):
    """The webhook could not be called or answered badly: failurePolicy decides."""


def _failed(hook: Mapping[str, Any], reason: object) -> str:
    return f'failed calling webhook "{hook.get("name")}": {reason}'


def _calling_failed(hook: Mapping[str, Any], reason: object) -> kmock.KubernetesError:
    return kubeobjects.failure(
        500, "InternalError", f"Internal error occurred: {_failed(hook, reason)}"
    )


# --- matching ---------------------------------------------------------------------------------


def _rule_matches(rule: Mapping[str, Any], write: Write) -> bool:
    def named(values: Any, value: str) -> bool:
        return isinstance(values, list) and ("*" in values or value in values)

    if not named(rule.get("operations"), write.operation):
        return False
    if not named(rule.get("apiGroups"), write.resource.group or ""):
        return False
    if not named(rule.get("apiVersions"), write.resource.version or ""):
        return False
    scope = rule.get("scope", "*")
    if scope != "*" and scope != ("Namespaced" if write.namespaced else "Cluster"):
        return False
    plural, sub = write.resource.plural or "", write.subresource
    for entry in rule.get("resources") or []:
        name, _, entry_sub = str(entry).partition("/")
        if name not in ("*", plural):
            continue
        if sub is None and not entry_sub:
            return True
        if sub is not None and entry_sub in ("*", sub):
            return True
        if sub is None and entry == "*/*":
            return True
    return False


def _labels(obj: Mapping[str, Any] | None) -> dict[str, str]:
    if obj is None:
        return {}
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector against labels; a missing or empty selector selects everything."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def write_of(
    request: kmock.Request,
    *,
    kind: str,
    namespaced: bool,
    operation: str,
    name: str,
    tokens: Mapping[str, dict[str, Any]],
) -> Write:
    """The ``Write`` a create/update request makes; the caller from its bearer token."""
    assert request.resource is not None
    headers = {key.lower(): value for key, value in request.headers.items()}
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        user = ANONYMOUS
    else:
        user = tokens.get(token.strip(), STAND_IN_ADMIN)
    options = {kmock.method.POST: "CreateOptions", kmock.method.PATCH: "PatchOptions"}.get(
        request.method, "UpdateOptions"
    )
    return Write(
        resource=request.resource,
        kind=kind,
        namespaced=namespaced,
        subresource=request.subresource,
        operation=operation,
        namespace=request.namespace if namespaced else None,
        name=name,
        user=copy.deepcopy(user),
        dry_run=request.params.get("dryRun") == "All",
        options_kind=options,
        field_validation=request.params.get("fieldValidation", "Warn"),
    )
