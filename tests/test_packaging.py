"""Repository-wide guarantees: reproducible stubs; a serving runtime that loads neither torch, the SDK nor the tools."""

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


def loaded_modules(statement: str) -> set[str]:
    """The modules a fresh interpreter in this checkout holds after running `statement`."""
    code = f"{statement}; import sys; print(*sys.modules, sep=chr(10))"
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_serving_code_imports_no_torch() -> None:
    loaded = loaded_modules("import service.__main__, service.launch.server, service.ops.healthcheck, client")
    assert not {m for m in loaded if m == "torch" or m.startswith(("torch.", "export"))}


def test_serving_runtime_imports_neither_the_sdk_nor_the_tools() -> None:
    loaded = loaded_modules("import service.__main__, service.launch.server, service.ops.healthcheck")
    assert not {m for m in loaded if m.split(".")[0] in ("client", "tools")}


def test_running_server_has_no_torch_library_mapped(tiny_server: RunningServer) -> None:
    maps = Path(f"/proc/{tiny_server.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "onnxruntime" in maps
