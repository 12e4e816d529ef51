"""The web console's files as the API's server serves them (``bettercompute.console``): the
pages and assets, the security headers on every console answer, and no way out of ``static/``
(over a raw socket, since an HTTP client would clean ``..`` out of the path before sending)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bettercompute import console
from tests.api.conftest import Api

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "refresh-console-assets"
LOCK = ROOT / "src" / "bettercompute" / "console" / "vendor.lock.json"


def assert_secured(response) -> None:
    assert response.headers["Content-Security-Policy"] == console.CSP
    assert "script-src 'self';" in console.CSP
    assert "unsafe-inline" not in console.CSP
    assert "unsafe-eval" not in console.CSP
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "no-referrer"


async def test_the_root_sends_a_browser_to_the_console(api: Api):
    for path in ("/", "/console"):
        response = await api.client.get(path)
        assert response.status_code == 302, path
        assert response.headers["Location"] == "/console/"
        assert_secured(response)


@pytest.mark.parametrize(
    ("path", "kind", "file"),
    [
        ("/console/", "text/html", "index.html"),
        ("/console/signin", "text/html", "signin.html"),
        ("/console/assets/vendor/echarts.min.js", "text/javascript", "vendor/echarts.min.js"),
        ("/console/assets/vendor/LICENSE-echarts.txt", "text/plain", "vendor/LICENSE-echarts.txt"),
    ],
)
async def test_the_pages_and_assets_are_the_shipped_files(
    api: Api, path: str, kind: str, file: str
):
    response = await api.client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith(kind)
    assert response.content == (console.STATIC / file).read_bytes()
    assert response.headers["Cache-Control"] == "no-cache"
    assert_secured(response)


async def test_every_console_answer_carries_the_policy_refusals_and_sessions_too(api: Api):
    for method, path in (
        ("GET", "/console/assets/no-such-file.js"),
        ("POST", "/console/"),
        ("POST", "/console/session"),  # no CSRF header: refused, still secured
        ("GET", "/console/session"),
    ):
        response = await api.client.request(method, path)
        assert response.status_code >= 400, (method, path)
        assert response.json()["error"]["code"] in ("NOT_FOUND", "INVALID_INPUT"), path
        assert_secured(response)
    # The API's own answers are left as they were.
    assert "Content-Security-Policy" not in (await api.client.get("/healthz")).headers


async def raw_get(base: str, target: str) -> tuple[int, bytes]:
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    status = int(answer.split(b" ", 2)[1])
    return status, answer


@pytest.mark.parametrize(
    "target",
    [
        "/console/assets/../../__init__.py",
        "/console/assets/../__init__.py",
        "/console/assets/vendor/../../__init__.py",
        "/console/assets/%2e%2e/%2e%2e/__init__.py",
        "/console/assets/..%2f__init__.py",
        "/console/assets/%2e%2e%2f%2e%2e%2fapi%2fapp.py",
        "/console/assets/..%5c__init__.py",
        "/console/assets//etc/passwd",
        "/console/assets/%2fetc%2fpasswd",
        "/console/assets/.hidden",
        "/console/assets/vendor",
    ],
)
async def test_no_path_leads_out_of_the_static_folder(api: Api, target: str):
    status, answer = await raw_get(api.base, target)
    assert status in (400, 404), answer[:200]
    assert b"def install" not in answer
    assert b"root:" not in answer
    assert b"from __future__" not in answer


def test_resolve_takes_only_plain_files_under_the_root(tmp_path: Path):
    root = tmp_path / "static"
    (root / "vendor").mkdir(parents=True)
    (root / "app.js").write_text("ok")
    (root / "vendor" / "lib.js").write_text("ok")
    (tmp_path / "secret.txt").write_text("secret")
    (root / "link.js").symlink_to(tmp_path / "secret.txt")
    assert console.resolve(root, "app.js") == root / "app.js"
    assert console.resolve(root, "vendor/lib.js") == root / "vendor" / "lib.js"
    for bad in (
        "../secret.txt",
        "vendor/../../secret.txt",
        "/secret.txt",
        "link.js",
        "vendor",
        ".",
        "",
        "vendor//lib.js",
        "..\\secret.txt",
        "C:secret.txt",
    ):
        assert console.resolve(root, bad) is None, bad


def test_the_vendored_files_are_the_locked_ones():
    lock = json.loads(LOCK.read_text())
    (echarts,) = [p for p in lock["packages"] if p["package"] == "echarts"]
    assert echarts["integrity"].startswith("sha512-")
    assert echarts["tarball"] == (
        f"https://registry.npmjs.org/echarts/-/echarts-{echarts['version']}.tgz"
    )
    assert echarts["license"] == "Apache-2.0"
    assert set(echarts["sha256"]) == {"echarts.min.js", "LICENSE-echarts.txt", "NOTICE-echarts.txt"}
    for file, digest in echarts["sha256"].items():
        data = (console.STATIC / "vendor" / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, file
    assert b"Apache License" in (console.STATIC / "vendor" / "LICENSE-echarts.txt").read_bytes()


def _tarball(tmp_path: Path, files: dict[str, bytes]) -> Path:
    path = tmp_path / "pkg.tgz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _lock(tmp_path: Path, tarball: Path, integrity: str, sha: dict[str, str]) -> Path:
    lock = tmp_path / "lock.json"
    lock.write_text(
        json.dumps(
            {
                "packages": [
                    {
                        "package": "demo",
                        "version": "1.0.0",
                        "license": "MIT",
                        "tarball": tarball.as_uri(),
                        "integrity": integrity,
                        "files": {"package/dist/demo.js": "demo.js", "package/LICENSE": "L.txt"},
                        "sha256": sha,
                    }
                ]
            }
        )
    )
    return lock


def test_the_refresh_script_writes_only_what_verifies(tmp_path: Path):
    js, licence = b"console.log(1)", b"MIT License"
    tarball = _tarball(tmp_path, {"package/dist/demo.js": js, "package/LICENSE": licence})
    good = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    sha = {"demo.js": hashlib.sha256(js).hexdigest(), "L.txt": hashlib.sha256(licence).hexdigest()}
    vendor = tmp_path / "vendor"

    def run(lock: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--lock", str(lock), "--vendor", str(vendor), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # A tarball that is not the locked one: refused, nothing written.
    bad = run(_lock(tmp_path, tarball, "sha512-" + "A" * 86 + "==", sha))
    assert bad.returncode == 1
    assert "integrity" in bad.stderr
    assert not vendor.exists()
    # A file whose hash is not the lock's: refused too.
    wrong = run(_lock(tmp_path, tarball, good, {**sha, "demo.js": "0" * 64}))
    assert wrong.returncode == 1
    assert "demo.js" in wrong.stderr
    assert not vendor.exists()
    # The locked tarball: written, and --check agrees; a changed file fails --check.
    lock = _lock(tmp_path, tarball, good, sha)
    assert run(lock).returncode == 0
    assert (vendor / "demo.js").read_bytes() == js
    assert run(lock, "--check").returncode == 0
    (vendor / "demo.js").write_bytes(b"tampered")
    tampered = run(lock, "--check")
    assert tampered.returncode == 1
    assert "demo.js" in tampered.stderr
