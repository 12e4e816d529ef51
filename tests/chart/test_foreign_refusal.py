"""The chart's ``devicePlugin.refuseForeignExposure``: on by default, it reaches the node agent's
``--refuse-foreign-exposure`` (parsed by the agent's own command line from the rendered
environment), ``false`` turns it off, and the schema takes only a boolean. What the agent does
with it is ``tests/deviceplugin/test_foreign_refusal.py``."""

from __future__ import annotations

from collections.abc import Callable

import helm_python
import pytest
import typer

from bettercompute.deviceplugin import agent
from tests.chart import rendering
from tests.chart.test_workloads import _params


def _refuses(rendered: rendering.Rendered, monkeypatch: pytest.MonkeyPatch) -> bool:
    (container,) = rendering.pod_spec(rendered.one("DaemonSet"))["containers"]
    params = _params(rendered, typer.main.get_command(agent.cli), container, monkeypatch)
    return bool(params["refuse_foreign_exposure"])


def test_by_default_the_agent_refuses_to_start_beside_another_path(
    defaults: rendering.Rendered, monkeypatch: pytest.MonkeyPatch
):
    assert _refuses(defaults, monkeypatch) is True


def test_false_lets_it_start_beside_one(render: Callable, monkeypatch: pytest.MonkeyPatch):
    rendered = render({"devicePlugin": {"refuseForeignExposure": False}})
    assert _refuses(rendered, monkeypatch) is False


def test_the_schema_takes_only_a_boolean(chart: helm_python.Chart):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, {"devicePlugin": {"refuseForeignExposure": "no"}})
    assert "refuseForeignExposure" in str(refused.value)
