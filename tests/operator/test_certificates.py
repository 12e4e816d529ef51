"""The operator notices a renewed webhook certificate (and only a real change)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bettercompute.operator import certificates


async def test_a_changed_certificate_is_noticed(tmp_path: Path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("cert v1")
    key.write_text("key v1")
    watching = asyncio.create_task(certificates.changed([cert, key], interval_s=0.01))
    await asyncio.sleep(0.1)
    assert not watching.done()  # nothing changed yet
    cert.write_text("cert v2")
    await asyncio.wait_for(watching, timeout=2)


async def test_a_briefly_missing_file_is_not_a_change(tmp_path: Path):
    cert = tmp_path / "tls.crt"
    cert.write_text("cert v1")
    watching = asyncio.create_task(certificates.changed([cert], interval_s=0.01))
    cert.unlink()  # a Secret update swapping its symlink
    await asyncio.sleep(0.1)
    cert.write_text("cert v1")
    await asyncio.sleep(0.1)
    assert not watching.done()
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
