"""Generate the Python stubs in protocol/ from the .proto files beside this script.

    python protos/generate.py            # rewrite protocol/*_pb2*.py(i)
    python protos/generate.py --check    # exit 1 if the committed stubs differ

Two edits follow protoc, both mechanical: imports become package-qualified
(`from protocol import ...`), and descriptors register in the package's private pool
instead of protobuf's default one, so that these stubs and tritonclient's (same proto package,
same file names) can be imported in one process.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
OUTPUT_DIR = PROTO_DIR.parent / "protocol"
PACKAGE = "protocol"
PROTO_FILES = ("model_config.proto", "grpc_service.proto")


def _rewrite(text: str) -> str:
    stems = [Path(name).stem for name in PROTO_FILES]
    for stem in stems:
        text = re.sub(rf"^import {stem}_pb2 as ", f"from {PACKAGE} import {stem}_pb2 as ", text, flags=re.MULTILINE)
        text = re.sub(rf"^import {stem}_pb2$", f"from {PACKAGE} import {stem}_pb2", text, flags=re.MULTILINE)
    if "_descriptor_pool.Default()" in text:
        text = text.replace("_descriptor_pool.Default()", "_proto_pool.POOL")
        text = text.replace(
            "# @@protoc_insertion_point(imports)",
            f"from {PACKAGE} import pool as _proto_pool\n# @@protoc_insertion_point(imports)",
        )
    return text


def generate(output_dir: Path) -> list[Path]:
    """Run protoc into output_dir and apply the rewrites; return the files written."""
    arguments = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={output_dir}",
        f"--pyi_out={output_dir}",
        f"--grpc_python_out={output_dir}",
        *(str(PROTO_DIR / name) for name in PROTO_FILES),
    ]
    if protoc.main(arguments) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(output_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        if path.name.endswith("_pb2_grpc.py") and "class " not in text:
            path.unlink()  # protoc writes a service module even for files that define no service
            continue
        path.write_text(_rewrite(text))
        written.append(path)
    return written


def main() -> int:
    """Generate, or with --check compare against the committed stubs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    check = parser.parse_args().check
    if not check:
        for path in generate(OUTPUT_DIR):
            print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        stale = [
            path.name
            for path in generate(Path(scratch))
            if not (OUTPUT_DIR / path.name).is_file() or (OUTPUT_DIR / path.name).read_text() != path.read_text()
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run python protos/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
