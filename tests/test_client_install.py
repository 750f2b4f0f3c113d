"""The client installs alone: `pip install encoder-serve` in a fresh virtual environment brings no ONNX Runtime.

The project is installed from a copy of its sources (as from an sdist), then the installed client
embeds a sentence from the running server, outside this checkout, and its command line ingests a
file (Parquet, whose extra is not installed, is refused in one line).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from client import EmbeddingClient
from tests.conftest import TINY_MODEL
from tests.installs import copy_project_source, fresh_environment, pip_install
from tests.servers import RunningServer

SERVER_ONLY = ("onnxruntime", "onnxruntime-gpu", "tokenizers", "torch", "prometheus-client", "grpcio-reflection")
CLIENT_MODULES = {
    *("client", "client.aio", "client.base", "client.blocking", "client.channels", "client.errors"),
    *("client.images", "client.protocol", "client.retry", "client.tasks"),
    *("protocol", "protocol.channel_security", "protocol.retry_hint"),
}
"""What `import client` may load of this project: the SDK, its channel settings and the stubs (protocol), never
service/."""
PROBE = """
import importlib.util, json, sys
from importlib import metadata
from client import EmbeddingClient
embedding = EmbeddingClient(sys.argv[1], model=sys.argv[2]).embed([sys.argv[3]])
print(json.dumps({
    "distributions": sorted(d.metadata["Name"].lower() for d in metadata.distributions()),
    "importable": [m for m in ("onnxruntime", "tokenizers", "torch") if importlib.util.find_spec(m)],
    "client_from": importlib.util.find_spec("client").origin,
    "tools_installed": importlib.util.find_spec("tools") is not None,
    "project_modules": sorted(
        m for m in sys.modules if m.split(".")[0] in ("client", "protocol", "service", "export", "tools")
    ),
    "embedding": embedding.tolist(),
}))
"""
SENTENCE = "A man is eating food."


def test_client_installs_without_the_runtime_and_embeds(tiny_server: RunningServer, tmp_path: Path) -> None:
    source = copy_project_source(tmp_path / "source")
    environment = tmp_path / "venv"
    python = fresh_environment(environment)
    pip_install(python, str(source))

    probe = subprocess.run(
        [python, "-c", PROBE, tiny_server.target, TINY_MODEL, SENTENCE],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=environment,  # so nothing of this checkout is importable
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert "encoder-serve" in found["distributions"]
    assert not set(SERVER_ONLY) & set(found["distributions"]), found["distributions"]
    assert found["importable"] == []
    assert Path(found["client_from"]).is_relative_to(environment)
    # The tools are installed beside the SDK, and the SDK loads none of them, nor the serving runtime.
    assert found["tools_installed"]
    loaded = set(found["project_modules"])
    assert (
        loaded - {m for m in loaded if (m.startswith("protocol.") and "_pb2" in m) or m == "protocol.pool"}
        == CLIENT_MODULES
    ), loaded
    expected = EmbeddingClient(tiny_server.target, model=TINY_MODEL).embed([SENTENCE])
    np.testing.assert_allclose(np.array(found["embedding"], dtype=np.float32), expected, atol=1e-6)

    texts = tmp_path / "texts.txt"
    texts.write_text(f"{SENTENCE}\nA second line.\n")
    command = [python, "-m", "client", "embed", str(texts), "--target", tiny_server.target, "--model", TINY_MODEL]
    ingest = subprocess.run(
        [*command, "--output", str(tmp_path / "vectors.npy"), "--quiet"],
        check=False, capture_output=True, text=True, timeout=120, cwd=environment,
    )  # fmt: skip
    assert ingest.returncode == 0, ingest.stderr
    np.testing.assert_allclose(np.load(tmp_path / "vectors.npy")[:1], expected, atol=1e-6)
    parquet = subprocess.run(
        [*command, "--output", str(tmp_path / "vectors.parquet")],
        check=False, capture_output=True, text=True, timeout=120, cwd=environment,
    )  # fmt: skip
    assert parquet.returncode == 1 and "needs pyarrow" in parquet.stderr
