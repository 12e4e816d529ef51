"""The release workflow: what a maintainer's tag sets off, checked before any tag is pushed.

actionlint (built from its Go module, ``tests/release/actionlint.py``) checks every workflow
file against GitHub Actions' schema, its expressions and the inputs of the actions it knows;
it is shown to refuse a broken copy, so a pass means something. Then the release workflow is
read for what docs/install/index.md promises: the tests first, both Dockerfile targets for
amd64 and arm64 with an SBOM and max provenance, keyless cosign signatures, and the chart
pushed to an OCI registry with this release's images as its defaults.

Without Go the actionlint tests skip, saying so; CI has Go, so none skip there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.release import actionlint

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
RELEASE = ROOT / ".github" / "workflows" / "release.yml"


@pytest.fixture(scope="module")
def lint() -> Path:
    try:
        return actionlint.build()
    except actionlint.BuildError as e:
        pytest.skip(f"actionlint cannot be built here: {e}")


def _run(lint: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    # shellcheck and pyflakes off: the same verdict wherever the test runs.
    return subprocess.run(
        [str(lint), "-no-color", "-oneline", "-shellcheck=", "-pyflakes=", *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_workflow_passes_actionlint(lint: Path) -> None:
    assert WORKFLOWS, "no workflow files"
    result = _run(lint, *WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_refuses_a_broken_workflow(lint: Path, tmp_path: Path) -> None:
    broken = RELEASE.read_text(encoding="utf-8").replace(
        "${{ matrix.target }}", "${{ matrix.targets }}"
    )
    broken = broken.replace("provenance: mode=max", "provenance: mode=max\n          sboms: true")
    folder = tmp_path / ".github" / "workflows"
    folder.mkdir(parents=True)
    (folder / "release.yml").write_text(broken, encoding="utf-8")
    result = _run(lint, folder / "release.yml")
    assert result.returncode == 1
    assert 'property "targets" is not defined' in result.stdout
    assert '"sboms" is not defined in action "docker/build-push-action' in result.stdout


def _workflow() -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(RELEASE.read_text(encoding="utf-8"))
    return loaded


def _steps(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in job["steps"] if str(s.get("uses", "")).startswith(action + "@")]


def test_a_tag_runs_the_tests_then_the_images_then_the_chart() -> None:
    workflow = _workflow()
    on = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert on == {"push": {"tags": ["v*.*.*"]}}
    assert workflow["permissions"] == {"contents": "read"}
    jobs = workflow["jobs"]
    assert jobs["images"]["needs"] == "test"
    assert jobs["chart"]["needs"] == "images"
    runs = [s.get("run", "") for s in jobs["test"]["steps"]]
    assert ".ci/run" in runs
    assert _steps(jobs["test"], "actions/setup-go")[0]["with"]["cache-dependency-path"]


def test_both_images_multi_arch_with_sbom_provenance_and_signatures() -> None:
    images = _workflow()["jobs"]["images"]
    targets = re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    shipped = {m["target"] for m in images["strategy"]["matrix"]["include"]}
    assert shipped == set(targets) - {"build", "runtime"} == {"operator", "node-agent"}
    assert _steps(images, "docker/setup-qemu-action")
    assert _steps(images, "docker/setup-buildx-action")
    (build,) = _steps(images, "docker/build-push-action")
    assert set(build["with"]["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert build["with"]["sbom"] is True
    assert build["with"]["provenance"] == "mode=max"
    assert build["with"]["push"] is True
    assert images["permissions"]["id-token"] == "write"
    assert _steps(images, "sigstore/cosign-installer")
    sign = [s for s in images["steps"] if "cosign sign" in s.get("run", "")]
    assert sign
    assert '"${IMAGE}@${DIGEST}"' in sign[0]["run"]  # by digest, never by a movable tag


def test_the_chart_is_pushed_to_an_oci_registry_and_signed() -> None:
    chart = _workflow()["jobs"]["chart"]
    script = "\n".join(s.get("run", "") for s in chart["steps"])
    assert "helm package charts/better-compute" in script
    assert 'helm push dist/better-compute-*.tgz "oci://${REGISTRY}/${OWNER}/charts"' in script
    assert 'cosign sign --yes "${REGISTRY}/${OWNER}/charts/better-compute@${digest}"' in script
    # The published chart's defaults are the images just pushed: the lines it rewrites exist.
    values = (ROOT / "charts" / "better-compute" / "values.yaml").read_text(encoding="utf-8")
    assert "\n  repository: better-compute\n" in values
    assert '\n  nodeRepository: ""\n' in values
