"""The pod webhooks' rules (``operator.podaccess``), table-driven on pods built as users write
them. The same rules run through the real operator and the API stand-in's admission chain in
``tests/operator/test_pod_webhooks.py``; here each rule is shown on its own."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from bettercompute.operator import podaccess

RSV = "bcd.dev/rsv-abcdefghjkmnpqrstvwxyz01"
OTHER_RSV = "bcd.dev/rsv-zzzzzzzzzzzzzzzzzzzzzzzz"


class PodBuilder:
    def __init__(self, name: str = "trainer", namespace: str = "ml") -> None:
        self._obj: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {}},
            "spec": {"containers": []},
        }

    def label(self, reservation: str) -> PodBuilder:
        self._obj["metadata"]["labels"]["bcd.dev/reservation"] = reservation
        return self

    def container(self, name: str = "main", *, init: bool = False, **limits: Any) -> PodBuilder:
        return self._add(name, init=init, resources={"limits": _names(limits)})

    def sidecar(self, name: str, **limits: Any) -> PodBuilder:
        return self._add(
            name, init=True, resources={"limits": _names(limits)}, restartPolicy="Always"
        )

    def requests(self, name: str = "main", **requests: Any) -> PodBuilder:
        return self._add(name, init=False, resources={"requests": _names(requests)})

    def _add(self, name: str, *, init: bool, **fields: Any) -> PodBuilder:
        key = "initContainers" if init else "containers"
        self._obj["spec"].setdefault(key, []).append({"name": name, "image": "x", **fields})
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)


def _names(counts: dict[str, Any]) -> dict[str, Any]:
    """``gpu=2`` → ``{"bcd.dev/gpu": "2"}``; ``rsv=1`` → this test's reservation resource."""
    known = {"gpu": "bcd.dev/gpu", "mig": "bcd.dev/gpu.mig", "slot": "bcd.dev/gpu.slot"}
    known |= {"rsv": RSV, "other": OTHER_RSV, "cpu": "cpu"}
    return {known.get(k, k): v for k, v in counts.items()}


def pod() -> PodBuilder:
    return PodBuilder()


def booked(
    name: str = "train",
    *,
    namespace: str = "ml",
    state: str | None = "active",
    binding: str = "kubernetes",
    resource_name: str | None = RSV,
    **per_node: int,
) -> podaccess.Booked:
    return podaccess.Booked(
        namespace=namespace,
        name=name,
        state=state,
        binding=binding,
        resource_name=resource_name,
        per_node=per_node or {"gpu": 2},
    )


def check(
    new: dict[str, Any],
    reservation: podaccess.Booked | None = None,
    *,
    owners: dict[str, podaccess.Booked] | None = None,
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
) -> str | None:
    if owners is None:
        owners = {RSV: booked()}
    return podaccess.refusal(
        operation=operation,
        pod=new,
        old=old,
        reservation_named=lambda ns, name: (
            reservation
            if reservation and (reservation.namespace, reservation.name) == (ns, name)
            else None
        ),
        owner_of=owners.get,
    )


def mutated(new: dict[str, Any], reservation: podaccess.Booked) -> dict[str, Any]:
    """The pod after the mutating webhook, as the API server would store it."""
    changes = podaccess.rewritten(new, reservation)
    assert changes is not None
    out = copy.deepcopy(new)
    out["spec"].update(changes["spec"])
    out["metadata"]["annotations"] = changes["annotations"]
    return out


# --- reading a Reservation -----------------------------------------------------------------------


def test_a_reservation_object_is_read_tolerantly():
    body = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {
            "binding": "kubernetes",
            "devices": [{"class": "gpu", "count": 2}, {"class": "mig", "count": 3}, "junk"],
            "gang": {"size": 4},
        },
        "status": {"state": "active", "resourceName": RSV},
    }
    seen = podaccess.booked(body)
    assert seen == booked(gpu=2, mig=3)
    assert seen.held == 5  # per node: the gang size does not multiply what one pod may take
    assert podaccess.booked({"metadata": {"name": "x"}}) == podaccess.Booked(
        namespace="", name="x", state=None, binding="hold", resource_name=None, per_node={}
    )


# --- the rewrite ---------------------------------------------------------------------------------


def test_a_labelled_pod_is_rewritten_in_containers_and_init_containers():
    new = (
        pod()
        .label("train")
        .container("setup", init=True, gpu=1)
        .container("main", gpu="2", cpu="4")
        .requests("helper", gpu=1)
        .obj()
    )
    changes = podaccess.rewritten(new, booked())
    assert changes is not None
    init, containers = changes["spec"]["initContainers"], changes["spec"]["containers"]
    assert init[0]["resources"] == {"limits": {RSV: "1"}}
    assert containers[0]["resources"] == {"limits": {"cpu": "4", RSV: "2"}}
    assert containers[1]["resources"] == {"requests": {RSV: "1"}}
    original = json.loads(changes["annotations"]["bcd.dev/original-resources"])
    assert original == {
        "initContainers": {"setup": {"limits": {"bcd.dev/gpu": 1}}},
        "containers": {
            "main": {"limits": {"bcd.dev/gpu": "2"}},
            "helper": {"requests": {"bcd.dev/gpu": 1}},
        },
    }
    # The rewritten pod passes the validating webhook.
    assert check(mutated(new, booked()), booked(gpu=3)) is None
    assert "asks 3 devices" in (check(mutated(new, booked()), booked()) or "")


def test_classes_the_reservation_holds_are_summed_into_its_resource_others_stay():
    new = pod().label("train").container(gpu=1, mig=2, slot=1).obj()
    changes = podaccess.rewritten(new, booked(gpu=1, mig=2))
    assert changes is not None
    assert changes["spec"]["containers"][0]["resources"]["limits"] == {
        "bcd.dev/gpu.slot": 1,
        RSV: "3",
    }


@pytest.mark.parametrize(
    ("new", "reservation"),
    [
        (pod().container(gpu=1).obj(), booked()),  # no label
        (pod().label("other").container(gpu=1).obj(), booked()),  # another reservation
        (pod().label("train").container(gpu=1).obj(), booked(resource_name=None)),  # shared
        (pod().label("train").container(gpu=1).obj(), booked(state="released")),
        (pod().label("train").container(gpu=1).obj(), booked(state=None)),
        (pod().label("train").container(gpu=1).obj(), booked(binding="hold")),
        (pod().label("train").container(cpu=1).obj(), booked()),  # asks no bcd device
        (pod().label("train").container(gpu="1.5").obj(), booked()),  # left for the refusal
    ],
    ids=["unlabelled", "other", "shared", "terminal", "unadmitted", "hold", "no-gpu", "bad"],
)
def test_nothing_is_rewritten_unless_the_reservation_can_take_it(new, reservation):
    assert podaccess.rewritten(new, reservation) is None


# --- the validating rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("new", "reservation", "expected"),
    [
        (
            pod().label("missing").container(gpu=1).obj(),
            None,
            "metadata.labels[bcd.dev/reservation]: Reservation 'missing' does not exist in "
            "namespace 'ml'",
        ),
        (
            pod().label("train").container(gpu=1).obj(),
            booked(state="expired"),
            "Reservation 'train' is expired: it holds no devices any more",
        ),
        (
            pod().label("train").container(gpu=1).obj(),
            booked(binding="hold"),
            "Reservation 'train' has binding 'hold'; only a Reservation with binding 'kubernetes'",
        ),
        (
            pod().label("train").container(gpu=1).obj(),
            booked(state=None),
            "Reservation 'train' is not admitted yet",
        ),
        (
            pod().label("train").container(rsv=3).obj(),
            booked(),
            "asks 3 devices of Reservation 'train', which holds 2 per node (2 gpu)",
        ),
        (
            pod().label("train").container(mig=1).obj(),
            booked(),
            "spec.containers[0]: asks bcd.dev/gpu.mig, which Reservation 'train' does not "
            "hold (it holds 2 gpu per node)",
        ),
        (
            pod().container(rsv=1).obj(),
            None,
            "asks bcd.dev/rsv-abcdefghjkmnpqrstvwxyz01 without the label bcd.dev/reservation",
        ),
        (
            pod().label("train").container(other=1).obj(),
            booked(),
            "asks bcd.dev/rsv-zzzzzzzzzzzzzzzzzzzzzzzz, which is no Reservation's resource",
        ),
        (
            pod().container(**{"bcd.dev/tpu": 1}).obj(),
            None,
            "asks bcd.dev/tpu, which bcd does not advertise",
        ),
        (
            pod().label("train").container(gpu="500m").obj(),
            booked(),
            "spec.containers[0].resources.limits[bcd.dev/gpu]: '500m' is not a whole number",
        ),
        (
            pod().label("train").container(gpu=3).obj(),
            booked(resource_name=None),
            "asks 3 bcd.dev/gpu, more than Reservation 'train' holds per node (2 gpu)",
        ),
    ],
    ids=[
        "missing",
        "terminal",
        "hold",
        "unadmitted",
        "too-many",
        "wrong-class",
        "rsv-without-label",
        "rsv-of-nobody",
        "not-ours",
        "fraction",
        "shared-too-many",
    ],
)
def test_refusals_name_the_reason(new, reservation, expected):
    problem = check(new, reservation)
    assert problem is not None
    assert expected in problem


def test_a_resource_of_another_namespaces_reservation_is_refused_however_it_is_asked():
    theirs = booked("train", namespace="team-b")
    owners = {RSV: theirs}
    # Directly, without a label; with a label naming a same-named Reservation of its own
    # namespace; in an init container only.
    mine = booked("train", resource_name=OTHER_RSV)
    for new in (
        pod().container(rsv=1).obj(),
        pod().label("train").container(rsv=1).obj(),
        pod().container("setup", init=True, rsv=1).container("main", cpu=1).obj(),
    ):
        problem = check(new, mine, owners=owners)
        assert problem is not None
        assert "the resource of a Reservation in another namespace" in problem


def test_a_held_class_left_unrewritten_is_refused_with_what_to_do():
    # The mutating webhook saw the Reservation before it was admitted (or a later mutating
    # webhook added the request): the pod would wait for shared devices it cannot have.
    problem = check(pod().label("train").container(gpu=1).obj(), booked())
    assert problem == (
        "spec.containers[0]: asks bcd.dev/gpu; a pod of Reservation 'train' gets its devices "
        f"as {RSV} (the mutating pod webhook rewrites bcd.dev/gpu on create: create the pod again)"
    )


def test_a_labelled_pod_may_not_ask_another_reservation_of_its_namespace():
    owners = {RSV: booked("train"), OTHER_RSV: booked("eval", resource_name=OTHER_RSV)}
    new = pod().label("train").container(other=1).obj()
    problem = check(new, booked("train"), owners=owners)
    assert problem is not None
    assert "the resource of Reservation 'eval', but its label names Reservation 'train'" in problem


@pytest.mark.parametrize(
    "new",
    [
        pod().container(cpu=1).obj(),  # no bcd device, no label
        pod().container(gpu=4).obj(),  # shared devices only: allowed (maybe a warning)
        pod().label("train").container(rsv=2).obj(),
        pod().label("train").container(gpu=2).obj(),  # shared-mode reservation below
    ],
    ids=["plain", "unlabelled-gpu", "own-rsv", "shared"],
)
def test_allowed(new):
    reservation = booked(resource_name=None) if "bcd.dev/gpu" in json.dumps(new) else booked()
    owners = {RSV: booked()}
    assert check(new, reservation, owners=owners) is None


def test_the_effective_request_counts_init_containers_as_kubernetes_does():
    # max(largest init, sum of app containers): 2 init then 1 + 1 app fits 2.
    fits = pod().label("train").container("a", init=True, rsv=2).container("b", rsv=1)
    fits = fits.container("c", rsv=1).obj()
    assert check(fits, booked()) is None
    # A sidecar (restartable init container) runs beside the app containers: 1 + 2 > 2.
    sidecar = pod().label("train").sidecar("proxy", rsv=1).container("b", rsv=2).obj()
    assert "asks 3 devices" in (check(sidecar, booked()) or "")
    # ... and beside the init containers started after it: 1 + 2 > 2.
    before_init = pod().label("train").sidecar("proxy", rsv=1)
    before_init = before_init.container("setup", init=True, rsv=2).container("b", rsv=1).obj()
    assert "asks 3 devices" in (check(before_init, booked()) or "")
    asks = podaccess.asks(pod().container("a", init=True, rsv=3).container("b", rsv=1).obj())
    assert podaccess.effective(asks) == {RSV: 3}


# --- updates -------------------------------------------------------------------------------------


def test_the_label_of_a_pod_that_asks_devices_cannot_change():
    old = mutated(pod().label("train").container(gpu=1).obj(), booked())
    for change in ("eval", None):
        new = copy.deepcopy(old)
        if change is None:
            del new["metadata"]["labels"]["bcd.dev/reservation"]
        else:
            new["metadata"]["labels"]["bcd.dev/reservation"] = change
        problem = check(new, booked("eval"), operation="UPDATE", old=old)
        assert problem is not None
        assert problem.startswith("metadata.labels[bcd.dev/reservation]: cannot change")
    # Adding the label to a pod that asks plain bcd.dev/gpu is a change too.
    plain = pod().container(gpu=1).obj()
    labelled = pod().label("train").container(gpu=1).obj()
    assert "cannot change" in (check(labelled, booked(), operation="UPDATE", old=plain) or "")


def test_other_updates_pass_even_after_the_reservation_ended():
    old = mutated(pod().label("train").container(gpu=1).obj(), booked())
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["app"] = "trainer"
    new["metadata"]["finalizers"] = ["example.com/keep"]
    assert check(new, booked(state="released"), operation="UPDATE", old=old) is None
    # A pod without bcd devices may take or drop the label: it gets nothing by it.
    plain = pod().container(cpu=1).obj()
    assert (
        check(pod().label("x").container(cpu=1).obj(), None, operation="UPDATE", old=plain) is None
    )
    # Devices that change on update (Kubernetes forbids it; a resize could try) are re-judged.
    moved = copy.deepcopy(old)
    moved["spec"]["containers"][0]["resources"]["limits"] = {OTHER_RSV: "1"}
    assert "no Reservation's resource" in (
        check(moved, booked(), operation="UPDATE", old=old) or ""
    )


# --- the warning ---------------------------------------------------------------------------------


def test_plain_gpus_without_a_label_are_warned_about_only_when_no_pool_shares():
    new = pod().container(gpu=1).obj()
    said = podaccess.warning(new, shared_pool_exists=False)
    assert said is not None
    assert said.startswith("asks bcd.dev/gpu without the label bcd.dev/reservation")
    assert podaccess.warning(new, shared_pool_exists=True) is None
    assert (
        podaccess.warning(pod().label("t").container(gpu=1).obj(), shared_pool_exists=False) is None
    )
    assert podaccess.warning(pod().container(cpu=1).obj(), shared_pool_exists=False) is None
    assert podaccess.shares_devices({"policy": {"kubernetes": True, "podAccess": "shared"}})
    assert not podaccess.shares_devices({"policy": {"kubernetes": True}})
    assert not podaccess.shares_devices({"policy": {"podAccess": "shared"}})


def test_the_reservation_is_read_only_when_a_rule_needs_it():
    labelled = pod().label("train").container(gpu=1).obj()
    assert podaccess.needs_reservation(operation="CREATE", pod=labelled, old=None)
    assert not podaccess.needs_reservation(
        operation="CREATE", pod=pod().container(gpu=1).obj(), old=None
    )
    relabelled = copy.deepcopy(labelled)
    relabelled["metadata"]["labels"]["app"] = "x"
    assert not podaccess.needs_reservation(operation="UPDATE", pod=relabelled, old=labelled)
    more = pod().label("train").container(gpu=2).obj()
    assert podaccess.needs_reservation(operation="UPDATE", pod=more, old=labelled)
    for name in ("train", "a.b-c", "x" * 253):
        assert podaccess.is_object_name(name)
    for name in ("", "Train", "a/b", "../x", "-a", "x" * 254, None, 3):
        assert not podaccess.is_object_name(name)


def test_a_pod_asking_devices_of_a_dra_reservation_is_told_to_use_its_claim_template():
    """A dra pool advertises no extended resource: without this refusal the pod would wait
    for bcd.dev/gpu forever. A pod that uses the claim template (no bcd resource) passes."""
    dra_reservation = podaccess.booked(
        {
            "metadata": {"namespace": "ml", "name": "train"},
            "spec": {"binding": "kubernetes", "devices": [{"class": "gpu", "count": 2}]},
            "status": {"state": "active", "claimTemplate": "train"},
        }
    )
    problem = check(pod().label("train").container(gpu=2).obj(), dra_reservation)
    assert problem is not None
    assert "through Dynamic Resource Allocation" in problem
    assert "resourceClaimTemplateName: train" in problem
    with_claim = pod().label("train").container(cpu=1).obj()
    with_claim["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "train"}]
    assert check(with_claim, dra_reservation) is None
