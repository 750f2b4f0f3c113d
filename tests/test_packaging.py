"""Repository-wide guarantees: reproducible stubs, and a serving runtime that never loads torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.servers import RunningServer

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto_files() -> None:
    result = subprocess.run(
        [sys.executable, "protos/generate.py", "--check"], check=False, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_serving_code_imports_no_torch() -> None:
    code = (
        "import sys, service.__main__, service.server, service.healthcheck, client; "
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'export'))]; "
        "sys.exit(f'loaded {loaded}' if loaded else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_running_server_has_no_torch_library_mapped(tiny_server: RunningServer) -> None:
    maps = Path(f"/proc/{tiny_server.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "onnxruntime" in maps
