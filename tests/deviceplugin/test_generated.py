"""The committed generated modules match what the generate command produces from the protos."""

from __future__ import annotations

from pathlib import Path

from bettercompute.proto import generate


def test_generated_modules_are_not_stale(tmp_path: Path) -> None:
    fresh = generate.generate(out_dir=tmp_path)
    committed = generate.generated_paths(root=generate.PROTO_ROOT)

    assert [path.relative_to(tmp_path) for path in fresh] == [
        path.relative_to(generate.PROTO_ROOT) for path in committed
    ]
    stale = [
        str(old.relative_to(generate.PROTO_ROOT))
        for new, old in zip(fresh, committed, strict=True)
        if not old.exists() or new.read_bytes() != old.read_bytes()
    ]
    assert not stale, f"generated modules are stale: {stale}; run `{generate.COMMAND}`"


def test_generated_imports_resolve_inside_our_package() -> None:
    for path in generate.generated_paths(root=generate.PROTO_ROOT):
        text = path.read_text(encoding="utf-8")
        for top in ("deviceplugin", "podresources", "dra", "pluginregistration"):
            assert f"from {top}" not in text, f"{path.name} imports {top} as a top-level package"
    grpc_module = generate.PROTO_ROOT / "deviceplugin/v1beta1/api_pb2_grpc.py"
    assert "from bettercompute.proto.deviceplugin.v1beta1 import api_pb2" in grpc_module.read_text(
        encoding="utf-8"
    )
