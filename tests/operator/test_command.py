"""``better-compute-operator``: --help that teaches, and one-line errors instead of tracebacks."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from bettercompute.operator import running
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import cli


def test_help_lists_the_settings_and_their_environment_variables():
    result = CliRunner().invoke(cli, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for expected in (
        "--database-url",
        "DATABASE_URL",
        "--webhook-port",
        "--metrics-port",
        "BCD_METRICS_PORT",
        "--metrics-host",
        "--standalone",
        "POD_NAMESPACE",
        "--policies",
        "Example",
    ):
        assert expected in result.output


def test_metrics_get_their_own_port_from_a_flag_or_the_environment(monkeypatch):
    served: list[OperatorConfig] = []

    async def serve(config: OperatorConfig) -> None:
        served.append(config)

    monkeypatch.setattr(running, "_serve", serve)
    base = ["--database-url", "postgresql://x/y"]
    for args, env, expected in (
        ([], {}, ("0.0.0.0", 9464)),
        ([], {"BCD_METRICS_PORT": "9500", "BCD_METRICS_HOST": "10.0.0.7"}, ("10.0.0.7", 9500)),
        (["--metrics-port", "0", "--metrics-host", "127.0.0.1"], {}, ("127.0.0.1", 0)),
    ):
        result = CliRunner().invoke(cli, base + args, env=env)
        assert result.exit_code == 0, result.output
        config = served.pop()
        assert (config.metrics_host, config.metrics_port) == expected
        assert config.http_port == 8080  # the API keeps its own
    refused = CliRunner().invoke(cli, [*base, "--metrics-port", "70000"])
    assert refused.exit_code == 2


def test_a_missing_database_url_is_a_usage_error():
    result = CliRunner().invoke(cli, [], env={"DATABASE_URL": ""})
    assert result.exit_code == 2
    assert "database-url" in result.output.lower()


def test_an_unreadable_policy_file_is_one_line_naming_it(tmp_path: Path):
    missing = tmp_path / "nope.cedar"
    result = CliRunner().invoke(
        cli, ["--database-url", "postgresql://x/y", "--policies", str(missing)]
    )
    assert result.exit_code == 1
    assert f"cannot read the policy file {missing}" in result.output
    assert "Traceback" not in result.output


def test_invalid_cedar_is_one_line(tmp_path: Path):
    bad = tmp_path / "bad.cedar"
    bad.write_text("permit (principal, action, resource) when { nonsense };")
    result = CliRunner().invoke(cli, ["--database-url", "postgresql://x/y", "--policies", str(bad)])
    assert result.exit_code == 1
    assert "the Cedar policies are not valid" in result.output
    assert "Traceback" not in result.output


def test_no_api_server_is_one_line(tmp_path: Path):
    result = CliRunner().invoke(
        cli,
        ["--database-url", "postgresql://x/y"],
        env={"KUBECONFIG": "", "HOME": str(tmp_path), "BCD_API_SERVER": ""},
    )
    assert result.exit_code == 1
    assert "no Kubernetes API server" in result.output


def test_a_certificate_authority_it_cannot_load_is_one_line(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [
                    {
                        "name": "k",
                        "cluster": {
                            "server": "https://127.0.0.1:1",
                            "certificate-authority-data": "bm90IGEgY2VydA==",  # "not a cert"
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    result = CliRunner().invoke(
        cli,
        ["--database-url", "postgresql://x/y"],
        env={"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), "BCD_API_SERVER": ""},
    )
    assert result.exit_code == 1
    assert "Kubernetes API https://127.0.0.1:1: cannot load its TLS certificate" in result.output
    assert "Traceback" not in result.output
