"""Regenerate the Python modules for our kubelet ``.proto`` files with one command.

Run ``python -m bettercompute.proto.generate``. It calls ``grpc_tools.protoc`` (from the
``grpcio-tools`` test extra) with ``--python_out``, ``--grpc_python_out`` and ``--pyi_out``, then
rewrites the generated absolute imports (``from deviceplugin.v1beta1 import api_pb2``) so they
resolve inside ``bettercompute.proto``. The output depends only on the ``.proto`` files and the
pinned ``grpcio-tools`` version, so the staleness test can regenerate into a temporary folder and
compare byte for byte. This module must never be imported at run time by the rest of the
package: it is a developer tool, and ``grpcio-tools`` is not a run-time dependency.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "bettercompute.proto"
COMMAND = "python -m bettercompute.proto.generate"

# Distinct import paths, so Python's default descriptor pool never sees two files of one name.
PROTO_FILES = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "pluginregistration/v1/api.proto",
)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

# The top-level folders of our import paths; grpc_tools imports them as if they were packages.
_TOP_LEVEL = sorted({name.split("/", 1)[0] for name in PROTO_FILES})
_IMPORT = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, _TOP_LEVEL))})([. ])", re.M)


def generated_paths(*, root: Path) -> list[Path]:
    """The generated files, relative to ``root``, in a fixed order."""
    paths: list[Path] = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        paths.extend(root / f"{stem}{suffix}" for suffix in GENERATED_SUFFIXES)
    return paths


def generate(*, out_dir: Path) -> list[Path]:
    """Generate every module into ``out_dir`` (mirroring the proto tree) and fix its imports."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # A scratch folder first, so a failed protoc run never leaves half-written modules behind.
    with tempfile.TemporaryDirectory() as scratch:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--pyi_out={scratch}",
            *PROTO_FILES,
        ]
        result = subprocess.run(command, cwd=PROTO_ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed ({result.returncode}): {result.stderr.strip()}")
        written: list[Path] = []
        for source, target in zip(
            generated_paths(root=Path(scratch)), generated_paths(root=out_dir), strict=True
        ):
            text = _IMPORT.sub(rf"\1 {PACKAGE}.\2\3", source.read_text(encoding="utf-8"))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def main() -> None:
    for path in generate(out_dir=PROTO_ROOT):
        print(path.relative_to(PROTO_ROOT))


if __name__ == "__main__":
    main()
