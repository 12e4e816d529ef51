"""The end-to-end tests' cluster: built and installed once for the module, or a skip that says
why (no Docker engine, no kind v0.27+, no kubectl). ``pytest -ra`` (the project's default)
prints the reason in the summary.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import clusters


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[clusters.Cluster]:
    reason = clusters.missing()
    if reason is not None:
        pytest.skip(f"end-to-end tests need Docker and kind: {reason}")
    workdir: Path = tmp_path_factory.mktemp("kind")
    with clusters.kind_cluster(workdir) as created:
        created.install(clusters.values())
        yield created
