"""The CRDs an earlier chart version shipped, summarised, to check an upgrade from it offline.

Why it exists: an upgrade must bring every CRD the earlier chart installed to the new schema
without losing what users stored (a CRD removed, a served version dropped, a spec field pruned).
A summary (names, scope, versions, and every field path with its type) is enough to check that
and small enough to keep as a fixture, so the test needs neither the git history nor a cluster.

Who calls it: ``tests/chart/test_crd_upgrade.py``; ``python -m tests.chart.upgrading <commit>
<chart version>`` writes ``tests/chart/fixtures/crds-<chart version>.json`` from the chart's
``crds/`` at that commit (run once per released chart version).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.chart import rendering

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CHART_CRDS = "charts/better-compute/crds"


def fields(node: Mapping[str, Any], path: str = "") -> dict[str, str]:
    """Every field path of an OpenAPI v3 schema (``.spec.a[].b{}``) → its type."""
    if node.get("x-kubernetes-int-or-string"):
        kind = "int-or-string"
    else:
        kind = str(node.get("type", "any"))
    found = {path or ".": kind}
    for name, child in (node.get("properties") or {}).items():
        found.update(fields(child, f"{path}.{name}"))
    if isinstance(node.get("items"), Mapping):
        found.update(fields(node["items"], f"{path}[]"))
    if isinstance(node.get("additionalProperties"), Mapping):
        found.update(fields(node["additionalProperties"], f"{path}{{}}"))
    return found


def summary(crd: Mapping[str, Any]) -> dict[str, Any]:
    spec = crd["spec"]
    return {
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "plural": spec["names"]["plural"],
        "scope": spec["scope"],
        "versions": {
            v["name"]: {
                "served": v["served"],
                "storage": v["storage"],
                "fields": fields(v["schema"]["openAPIV3Schema"]),
            }
            for v in spec["versions"]
        },
    }


def summaries(crds: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """CRD name → summary."""
    return {crd["metadata"]["name"]: summary(crd) for crd in crds}


def load(version: str) -> dict[str, Any]:
    """The fixture of chart ``version``: {"chart", "commit", "crds": {name: summary}}."""
    found: dict[str, Any] = json.loads(
        (FIXTURES / f"crds-{version}.json").read_text(encoding="utf-8")
    )
    return found


def at_commit(commit: str) -> list[dict[str, Any]]:
    """The chart's CRDs at ``commit`` of this repository."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=rendering.ROOT, capture_output=True, text=True, check=True
        ).stdout

    names = git("ls-tree", "--name-only", f"{commit}:{CHART_CRDS}").split()
    return [
        yaml.safe_load(git("show", f"{commit}:{CHART_CRDS}/{name}"))
        for name in names
        if name.endswith(".yaml")
    ]


def main() -> None:
    commit, version = sys.argv[1], sys.argv[2]
    fixture = {"chart": version, "commit": commit, "crds": summaries(at_commit(commit))}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / f"crds-{version}.json"
    path.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    sys.stdout.write(f"wrote {path} ({len(fixture['crds'])} CRDs of {commit})\n")


if __name__ == "__main__":
    main()
