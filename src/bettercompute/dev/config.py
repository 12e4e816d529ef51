"""The dev stack's configuration: one YAML file describing a small world to reserve in.

Tenants, identities with their tokens, pools, offers, quotas, budgets, Cedar policies and the
simulated nodes, validated whole before anything is written: unknown keys, bad values and
dangling references (an identity of a tenant that does not exist, an offer of an unknown pool)
are a ``ConfigError`` whose message names the file, the line, the path in the file
(``pools[1].sharing``) and the reason. ``docs/dev-config.md`` documents the format.

The pools, offers and quotas are ``core.pools``'s models, the ones the operator parses a
``GPUPool`` with; what is here is the file's own shape: tenants, identities, budgets, policy
files, simulated node sets, and the references between them.

What it must never do: write to the database or start anything. ``applying`` writes a loaded
configuration; ``running`` starts the stack.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Discriminator, Field, Tag, ValidationError

from bettercompute.core import validation
from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError
from bettercompute.core.pools import GpuModel, Id, Model, Offer, Pool, Quota
from bettercompute.core.requests import MigProfile
from bettercompute.core.validation import Loc
from bettercompute.iam import policies as cedar
from bettercompute.sim import inventories

#: The configuration ``better-compute dev`` uses when given none.
DEMO = "demo.yaml"

#: Node sets of a MIG pool that name no profile get seven 1g.10gb instances per GPU.
DEFAULT_MIG = {"1g.10gb": 7}

IdentityId = Annotated[
    str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$")
]
Token = Annotated[str, Field(min_length=8, max_length=512, pattern=r"^[\x21-\x7e]+$")]
NodePrefix = Annotated[str, Field(min_length=1, max_length=48, pattern=r"^[a-z0-9][a-z0-9-]*$")]


class ConfigError(Exception):
    """A configuration that cannot be used: which file, where in it, and why."""

    def __init__(self, *, file: Path | str, reason: str, path: str = "", line: int | None = None):
        self.file = str(file)
        self.path = path
        self.reason = reason
        self.line = line
        where = f"{self.file}:{line}" if line is not None else self.file
        super().__init__(f"{where}: {path}: {reason}" if path else f"{where}: {reason}")


class Tenant(Model):
    id: Id
    name: str = ""
    root: bool = False


class Identity(Model):
    id: IdentityId
    tenant: Id
    token: Token
    kind: Literal["user", "agent", "service"] = "user"
    groups: list[Id] = Field(default_factory=list)
    #: For ``kind: agent`` only: the identity id of the person (a user of the same tenant) it
    #: acts for, whose confirmation a ``@confirm`` policy asks for.
    actingFor: IdentityId | None = None


class Budget(Model):
    tenant: Id
    gpuHours: float = Field(ge=0)
    windowSeconds: int = Field(gt=0, le=2**31 - 1)


class PolicyFile(Model):
    file: str = Field(min_length=1)


# Union tags: pydantic puts them in an error's location, and ``loads`` leaves them out.
_TEXT, _FILE = "cedar-text", "cedar-file"


def _policy_kind(value: Any) -> str:
    return _FILE if isinstance(value, dict) else _TEXT


# A policy is Cedar text, or {file: path relative to the YAML}.
PolicyItem = Annotated[
    Annotated[str, Tag(_TEXT)] | Annotated[PolicyFile, Tag(_FILE)],
    Discriminator(_policy_kind),
]


class NodeSet(Model):
    """``count`` simulated nodes of one pool, all alike."""

    pool: Id
    count: int = Field(default=1, ge=0, le=256)
    gpus: int = Field(default=8, ge=1, le=64)
    nvlinkDomains: int = Field(default=2, ge=0, le=64)
    numaNodes: int = Field(default=2, ge=1, le=8)
    model: GpuModel | None = None
    mig: dict[MigProfile, Annotated[int, Field(ge=1, le=7)]] | None = None
    slots: int | None = Field(default=None, ge=1, le=64)
    labels: dict[str, str] | None = None
    namePrefix: NodePrefix | None = None


def _egress_entry(value: str) -> str:
    EgressPolicy.parse([value])  # ValueError: pydantic reports it at the entry's path
    return value


class Webhooks(Model):
    """Event webhook deliveries: where they may go beyond global addresses (``core.egress``).
    A receiver on this machine needs ``allow: [127.0.0.1]``."""

    allow: list[Annotated[str, Field(min_length=1), AfterValidator(_egress_entry)]] = Field(
        default_factory=list
    )

    def policy(self) -> EgressPolicy:
        return EgressPolicy.parse(self.allow)


class DevConfig(Model):
    tenants: list[Tenant] = Field(default_factory=list)
    identities: list[Identity] = Field(default_factory=list)
    pools: list[Pool] = Field(default_factory=list)
    offers: list[Offer] = Field(default_factory=list)
    quotas: list[Quota] = Field(default_factory=list)
    budgets: list[Budget] = Field(default_factory=list)
    #: Put ``iam.policies.DEFAULT_POLICIES`` before ``policies``.
    defaultPolicies: bool = True
    policies: list[PolicyItem] = Field(default_factory=list)
    nodes: list[NodeSet] | None = None
    webhooks: Webhooks = Field(default_factory=Webhooks)


@dataclass(frozen=True)
class LoadedConfig:
    """A configuration checked whole, with its Cedar policy texts read and parsed."""

    source: Path
    config: DevConfig
    policy_texts: tuple[str, ...]

    def policy_engine(self) -> cedar.CedarPolicyEngine:
        return cedar.CedarPolicyEngine.from_texts(self.policy_texts, validate=True)

    def tenant(self, tenant_id: str) -> Tenant:
        return next(t for t in self.config.tenants if t.id == tenant_id)

    def pool(self, pool_id: str) -> Pool:
        return next(p for p in self.config.pools if p.id == pool_id)


def demo_path() -> Path:
    """The shipped ``demo.yaml``."""
    return Path(str(resources.files("bettercompute.dev").joinpath(DEMO)))


def load(path: Path | None = None) -> LoadedConfig:
    """Read, validate and cross-check the YAML at ``path`` (the shipped demo when ``None``)."""
    source = path if path is not None else demo_path()
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(file=source, reason=f"cannot read the file: {_os_reason(e)}") from None
    return loads(text, source=source)


def loads(text: str, *, source: Path) -> LoadedConfig:
    """``load`` for text already read; ``source`` names the file in errors and anchors policy
    files."""
    try:
        data = yaml.safe_load(text)
        tree = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(file=source, line=line, reason=f"invalid YAML: {problem}") from None
    if data is None:
        raise ConfigError(file=source, reason="the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(file=source, line=1, reason="must be a mapping of sections")
    try:
        config = DevConfig.model_validate(data)
    except ValidationError as e:
        loc, reason = validation.first_problem(e, DevConfig, tags=(_TEXT, _FILE))
        raise ConfigError(
            file=source, path=validation.path(loc), line=_line(tree, loc), reason=reason
        ) from None
    problem = _cross_check(config)
    if problem is not None:
        loc, reason = problem
        raise ConfigError(
            file=source, path=validation.path(loc), line=_line(tree, loc), reason=reason
        )
    texts = _policy_texts(config, source=source, tree=tree)
    return LoadedConfig(source=source, config=config, policy_texts=texts)


# --- simulated nodes --------------------------------------------------------------------------


def sim_nodes(loaded: LoadedConfig, *, sim: int) -> list[inventories.SimNode]:
    """The simulated nodes to run: the configuration's ``nodes``, and ``sim`` nodes of the
    first pool when ``nodes`` names none for it (the configuration wins: ``--sim`` never
    changes a pool the file gives nodes for)."""
    config = loaded.config
    sets = list(config.nodes or [])
    if sim > 0 and config.pools and not any(s.pool == config.pools[0].id for s in sets):
        sets.insert(0, NodeSet(pool=config.pools[0].id, count=sim))
    built: list[inventories.SimNode] = []
    # Several sets of one pool (or one prefix) number their nodes on from each other.
    numbered: dict[str, int] = {}
    for node_set in sets:
        pool = loaded.pool(node_set.pool)
        stem = inventories.name_stem(pool_id=pool.id, prefix=node_set.namePrefix)
        first = numbered.get(stem, 0)
        numbered[stem] = first + node_set.count
        mig, slots = _sharing(node_set, pool)
        for name in inventories.node_names(
            pool_id=pool.id, count=node_set.count, first=first, prefix=node_set.namePrefix
        ):
            built.append(
                inventories.node(
                    name=name,
                    pool_id=pool.id,
                    model=node_set.model or pool.model,
                    gpus=node_set.gpus,
                    nvlink_domains=min(node_set.nvlinkDomains, node_set.gpus),
                    numa_nodes=node_set.numaNodes,
                    mig=mig,
                    slots=slots,
                    labels=node_set.labels,
                )
            )
    names = [n.name for n in built]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise ConfigError(
            file=loaded.source,
            path="nodes",
            reason=f"two simulated nodes would be named {clash}: give the sets a namePrefix",
        )
    return built


def _sharing(node_set: NodeSet, pool: Pool) -> tuple[dict[str, int] | None, int]:
    if pool.sharing == "mig":
        return dict(node_set.mig or DEFAULT_MIG), 0
    if pool.sharing in ("timeslice", "mps"):
        return None, node_set.slots or pool.replicas
    return None, 0


# --- checks -----------------------------------------------------------------------------------


def _cross_check(config: DevConfig) -> tuple[Loc, str] | None:
    """The first reference or rule the models alone cannot check, as (path, reason)."""
    tenants = {t.id for t in config.tenants}
    pools = {p.id: p for p in config.pools}

    for section, key in (("tenants", "id"), ("identities", "id"), ("pools", "id")):
        seen: set[str] = set()
        for i, item in enumerate(getattr(config, section)):
            value = getattr(item, key)
            if value in seen:
                return (section, i, key), f"duplicate id {value!r}"
            seen.add(value)
    roots = [i for i, t in enumerate(config.tenants) if t.root]
    if len(roots) > 1:
        return ("tenants", roots[1], "root"), "only one tenant may be the root tenant"

    tokens: set[str] = set()
    for i, identity in enumerate(config.identities):
        if identity.tenant not in tenants:
            return ("identities", i, "tenant"), _unknown("tenant", identity.tenant, tenants)
        if identity.token in tokens:
            return ("identities", i, "token"), "this token is already another identity's"
        tokens.add(identity.token)
    problem = _check_acting_for(config)
    if problem is not None:
        return problem

    for i, pool in enumerate(config.pools):
        if pool.owner not in tenants:
            return ("pools", i, "owner"), _unknown("tenant", pool.owner, tenants)

    offered: set[tuple[str, str]] = set()
    for i, offer in enumerate(config.offers):
        if offer.pool not in pools:
            return ("offers", i, "pool"), _unknown("pool", offer.pool, pools)
        if offer.tenant not in tenants:
            return ("offers", i, "tenant"), _unknown("tenant", offer.tenant, tenants)
        if pools[offer.pool].owner == offer.tenant:
            reason = f"{offer.tenant} owns {offer.pool}: owners need no offer"
            return ("offers", i, "tenant"), reason
        if (offer.pool, offer.tenant) in offered:
            return ("offers", i), f"{offer.pool} is already offered to {offer.tenant}"
        offered.add((offer.pool, offer.tenant))

    quotas: set[tuple[str, str]] = set()
    for i, quota in enumerate(config.quotas):
        if quota.tenant not in tenants:
            return ("quotas", i, "tenant"), _unknown("tenant", quota.tenant, tenants)
        if (quota.tenant, quota.resource) in quotas:
            return ("quotas", i), f"{quota.tenant} already has a quota for {quota.resource}"
        quotas.add((quota.tenant, quota.resource))

    budgets: set[str] = set()
    for i, budget in enumerate(config.budgets):
        if budget.tenant not in tenants:
            return ("budgets", i, "tenant"), _unknown("tenant", budget.tenant, tenants)
        if budget.tenant in budgets:
            return ("budgets", i), f"{budget.tenant} already has a budget"
        budgets.add(budget.tenant)

    return _check_nodes(config, pools)


def _check_acting_for(config: DevConfig) -> tuple[Loc, str] | None:
    """An agent acts for a user of its own tenant; nobody else acts for anyone."""
    by_id = {identity.id: identity for identity in config.identities}
    for i, identity in enumerate(config.identities):
        person_id = identity.actingFor
        if person_id is None:
            continue
        loc: Loc = ("identities", i, "actingFor")
        if identity.kind != "agent":
            return (
                loc,
                f"only an identity of kind 'agent' acts for a person (this is a {identity.kind})",
            )
        person = by_id.get(person_id)
        if person is None:
            return loc, _unknown("identity", person_id, by_id)
        if person.id == identity.id:
            return loc, "an agent cannot act for itself"
        if person.kind != "user":
            return loc, f"{person_id} is a {person.kind}: an agent acts for a user"
        if person.tenant != identity.tenant:
            return loc, f"{person_id} is of tenant {person.tenant}, not {identity.tenant}"
    return None


def _check_nodes(config: DevConfig, pools: Mapping[str, Pool]) -> tuple[Loc, str] | None:
    prefixes: dict[str, str] = {}
    for i, node_set in enumerate(config.nodes or []):
        if node_set.pool not in pools:
            return ("nodes", i, "pool"), _unknown("pool", node_set.pool, pools)
        pool = pools[node_set.pool]
        if node_set.model and pool.model and node_set.model != pool.model:
            return ("nodes", i, "model"), f"{pool.id} is a {pool.model} pool"
        if node_set.nvlinkDomains > node_set.gpus:
            return ("nodes", i, "nvlinkDomains"), f"more domains than GPUs ({node_set.gpus})"
        if pool.sharing == "mig" and node_set.slots is not None:
            return ("nodes", i, "slots"), f"{pool.id} shares by MIG: give 'mig', not 'slots'"
        if pool.sharing != "mig" and node_set.mig is not None:
            return ("nodes", i, "mig"), f"{pool.id} shares as '{pool.sharing}', not by MIG"
        if pool.sharing == "exclusive" and node_set.slots is not None:
            return ("nodes", i, "slots"), f"{pool.id} is exclusive: whole GPUs, no slots"
        if node_set.mig is not None:
            try:
                inventories.check_mig(node_set.mig)
            except ValueError as e:
                return ("nodes", i, "mig"), str(e)
        stem = inventories.name_stem(pool_id=pool.id, prefix=node_set.namePrefix)
        if prefixes.setdefault(stem, pool.id) != pool.id:
            return (
                ("nodes", i, "namePrefix" if node_set.namePrefix else "pool"),
                f"node names {stem}-NN are already another pool's; set a namePrefix",
            )
    return None


def _policy_texts(config: DevConfig, *, source: Path, tree: yaml.Node | None) -> tuple[str, ...]:
    texts: list[str] = [cedar.DEFAULT_POLICIES] if config.defaultPolicies else []
    for i, item in enumerate(config.policies):
        loc: Loc = ("policies", i)
        if isinstance(item, PolicyFile):
            file = (source.parent / item.file).resolve()
            loc = ("policies", i, "file")
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    file=source,
                    path=validation.path(loc),
                    line=_line(tree, loc),
                    reason=f"cannot read {file}: {_os_reason(e)}",
                ) from None
        else:
            text = item
        try:
            cedar.CedarPolicyEngine.from_text(text, validate=True)
        except ComputeError as e:
            raise ConfigError(
                file=source, path=validation.path(loc), line=_line(tree, loc), reason=e.message
            ) from None
        texts.append(text)
    try:
        cedar.CedarPolicyEngine.from_texts(texts, validate=True)
    except ComputeError as e:
        # Each parses alone, so what is left is between them: a repeated @id.
        raise ConfigError(
            file=source, path="policies", line=_line(tree, ("policies",)), reason=e.message
        ) from None
    return tuple(texts)


# --- messages ---------------------------------------------------------------------------------


def _unknown(what: str, value: str, known: Mapping[str, Any] | set[str]) -> str:
    names = sorted(known)
    hint = difflib.get_close_matches(value, names, n=1)
    if hint:
        return f"unknown {what} {value!r}; did you mean {hint[0]!r}?"
    listed = ", ".join(names) if names else "none defined"
    return f"unknown {what} {value!r} (defined: {listed})"


def _line(tree: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """The line of ``loc`` in the YAML, or of its nearest ancestor present there."""
    node = tree
    line = tree.start_mark.line + 1 if tree is not None else None
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def _os_reason(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)
