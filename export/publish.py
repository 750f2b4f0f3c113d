"""Writing a model into a repository: config.pbtxt, variant files, tokenizer, parity.json, fidelity.npz.

A two-tower model's (service.core.towers' layout) also: its image graphs, their fidelity reference and its
preprocessor_config.json.

Everything is written to a staging folder inside the repository and moved into place at the
end, so a failed export leaves the repository as it was.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export.checkpoints.checkpoint import Checkpoint
from export.graph.forms import FP32_GRAPH_OPTIMIZATION
from export.graph.onnx_export import copy_onnx
from export.heads.head import SEQUENCE
from export.heads.registry import graph_outputs
from protocol import model_config_pb2 as mc
from service.core.fidelity import FidelityReference
from service.core.repository import (
    CONFIG_FILE,
    EMBEDDING_RANGES_FILE,
    FIDELITY_FILE,
    GRAPH_LEVELS,
    P_ADAPTER_TASKS,
    P_DEFAULT_PROMPT_NAME,
    P_EMBEDDING_CALIBRATION,
    P_EMBEDDING_RANGES,
    P_MATRYOSHKA_DIMENSIONS,
    P_MAX_SEQUENCE_LENGTH,
    P_MODEL_TYPE,
    P_NORMALIZE,
    P_PAD_TOKEN_ID,
    P_POOLING,
    P_PREFERRED_PREFIX,
    P_PROMPTS,
    P_SIMILARITY_FN_NAME,
    P_TASK,
    P_TOKENIZER,
    P_TYPE_VOCAB_SIZE,
    P_VARIANT_PREFIX,
    P_VOCAB_SIZE,
    PARITY_FILE,
    PLATFORM,
    VARIANT_FILES,
    config_text,
    write_embedding_ranges,
)
from service.core.towers import (
    IMAGE_FIDELITY_FILE,
    IMAGE_VARIANT_FILES,
    P_IMAGE_PREPROCESSOR,
    P_IMAGE_VARIANT_PREFIX,
    P_TEXT_PADDING,
)

VERSION = "1"


@dataclass(frozen=True)
class ServingDefaults:
    """Batching facts written into config.pbtxt (the server's flags can override them).

    No queue delay by default: the batcher is work-conserving (a batch starts as soon as an
    instance is free, with whatever is queued), so batches grow with load on their own, and a
    lone request does not wait. A delay buys fuller batches at the cost of that latency.
    """

    max_batch_size: int = 64
    max_queue_delay_us: int = 0
    max_queue_size: int = 1024


def build_config(
    checkpoint: Checkpoint,
    input_names: list[str],
    variants: list[str],
    preferred: dict[str, str],
    defaults: ServingDefaults,
    *,
    calibration: dict[str, object] | None = None,
) -> mc.ModelConfig:
    """The model's Triton ModelConfig, with our serving facts as parameters.

    calibration: what the embedding's ranges were measured on (export.graph.calibration), when they were.
    """
    config = mc.ModelConfig(
        name=checkpoint.name,
        platform=PLATFORM,
        max_batch_size=defaults.max_batch_size,
        default_model_filename=VARIANT_FILES["fp32"],
    )
    for name in input_names:
        config.input.add(name=name, data_type=mc.TYPE_INT64, dims=[-1])
    _declare_outputs(config, checkpoint)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    # Triton's field, so that Triton too runs the fp32 graph in the form that was measured fastest.
    config.optimization.graph.level = next(v for v, name in GRAPH_LEVELS.items() if name == FP32_GRAPH_OPTIMIZATION)
    batching = config.dynamic_batching
    batching.max_queue_delay_microseconds = defaults.max_queue_delay_us
    batching.default_queue_policy.max_queue_size = defaults.max_queue_size
    parameters = {
        P_MAX_SEQUENCE_LENGTH: str(checkpoint.max_seq_length),
        P_VOCAB_SIZE: str(checkpoint.config.vocab_size),
        P_TYPE_VOCAB_SIZE: str(checkpoint.config.type_vocab_size if checkpoint.config.uses_segments else 0),
        P_MODEL_TYPE: checkpoint.model_type,
        P_TASK: checkpoint.task,
        P_PAD_TOKEN_ID: str(checkpoint.config.pad_token_id),
    }
    parameters |= _task_parameters(checkpoint)
    if calibration is not None:
        parameters[P_EMBEDDING_RANGES] = EMBEDDING_RANGES_FILE
        parameters[P_EMBEDDING_CALIBRATION] = f"{calibration['corpus']}: {calibration['texts']} texts"
    if checkpoint.tokenizer_files:
        parameters[P_TOKENIZER] = "tokenizer.json"
    for variant in variants:
        parameters[P_VARIANT_PREFIX + variant] = VARIANT_FILES[variant]
    for device, variant in preferred.items():
        parameters[P_PREFERRED_PREFIX + device] = variant
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def declare_image_tower(config: mc.ModelConfig, checkpoint: Checkpoint, variants: list[str], preprocessor: str) -> None:
    """A text tower's config made a two-tower model's: one output (embedding), image graphs, preprocessor, padding."""
    del config.output[:]
    config.output.add(name="embedding", data_type=mc.TYPE_FP32, dims=[checkpoint.config.d_model])
    parameters = {P_IMAGE_VARIANT_PREFIX + variant: IMAGE_VARIANT_FILES[variant] for variant in variants}
    parameters |= {P_IMAGE_PREPROCESSOR: preprocessor, P_TEXT_PADDING: checkpoint.config.text_padding}
    for key, value in parameters.items():
        config.parameters[key].string_value = value


def _declare_outputs(config: mc.ModelConfig, checkpoint: Checkpoint) -> None:
    """The graph's outputs, as the head declares them (a plain embedder's: its hidden states and embedding)."""
    for output in graph_outputs(checkpoint.config, checkpoint.head):
        dims = [-1 if dim == SEQUENCE else dim for dim in output.dims]
        config.output.add(name=output.name, data_type=mc.TYPE_FP32, dims=dims)


def _task_parameters(checkpoint: Checkpoint) -> dict[str, str]:
    """The task's own parameters (prompts, pooling and what the embedding declares), then the head's own."""
    declaration = checkpoint.head_declaration
    head_parameters = {} if declaration is None else declaration.parameters(checkpoint.head)
    if checkpoint.task in ("sparse", "multivector"):
        return _prompt_parameters(checkpoint) | head_parameters
    if checkpoint.task == "classify":
        return head_parameters
    parameters = {
        P_POOLING: checkpoint.config.pooling,
        P_NORMALIZE: str(checkpoint.config.normalize).lower(),
    } | _embedding_parameters(checkpoint)
    if getattr(checkpoint.config, "tasks", ()):
        parameters[P_ADAPTER_TASKS] = json.dumps(list(checkpoint.config.tasks))
    return parameters | head_parameters


def _prompt_parameters(checkpoint: Checkpoint) -> dict[str, str]:
    """The prompts a sentence-transformers source declares, and its default one, where it declares them."""
    serving = checkpoint.serving
    parameters = {}
    if serving.prompts:
        parameters[P_PROMPTS] = json.dumps(serving.prompts)
    if serving.default_prompt_name:
        parameters[P_DEFAULT_PROMPT_NAME] = serving.default_prompt_name
    return parameters


def _embedding_parameters(checkpoint: Checkpoint) -> dict[str, str]:
    """What a sentence-transformers source declares for its embeddings, where it declares anything."""
    serving = checkpoint.serving
    parameters = _prompt_parameters(checkpoint)
    if serving.similarity_fn_name:
        parameters[P_SIMILARITY_FN_NAME] = serving.similarity_fn_name
    if serving.matryoshka_dimensions:
        parameters[P_MATRYOSHKA_DIMENSIONS] = json.dumps(list(serving.matryoshka_dimensions))
    return parameters


def _replace_folder(staging: Path, target: Path) -> None:
    """Move staging to target; an existing target is swapped out and removed afterwards."""
    if not target.exists():
        staging.rename(target)
        return
    retired = target.with_name(f".retired-{target.name}-{staging.name}")
    target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired)


def publish(
    repository: Path,
    checkpoint: Checkpoint,
    config: mc.ModelConfig,
    variant_files: dict[str, Path],
    *,
    parity: dict[str, object],
    fidelity: FidelityReference,
    embedding_ranges: dict[int, np.ndarray],
    image_variant_files: dict[str, Path] | None = None,
    image_fidelity: FidelityReference | None = None,
    shipped_files: tuple[Path, ...] = (),
) -> Path:
    """Write the model folder atomically into the repository and return its path.

    image_variant_files: a two-tower model's image graphs (variant -> graph); image_fidelity: their reference for
    the check at load; shipped_files: copied beside the tokenizer files (a two-tower model's preprocessor_config.json).
    """
    repository.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".staging-{checkpoint.name}-", dir=repository) as scratch:
        staging = Path(scratch) / checkpoint.name
        version_dir = staging / VERSION
        version_dir.mkdir(parents=True)
        for variant, source in variant_files.items():
            copy_onnx(source, version_dir / VARIANT_FILES[variant])
        for variant, source in (image_variant_files or {}).items():
            copy_onnx(source, version_dir / IMAGE_VARIANT_FILES[variant])
        for shipped in (*checkpoint.tokenizer_files, *shipped_files):
            shutil.copyfile(shipped, staging / shipped.name)
        (staging / PARITY_FILE).write_text(json.dumps(parity, indent=2) + "\n")
        fidelity.save(staging / FIDELITY_FILE)
        if image_fidelity is not None:
            image_fidelity.save(staging / IMAGE_FIDELITY_FILE)
        if embedding_ranges:
            write_embedding_ranges(staging / EMBEDDING_RANGES_FILE, embedding_ranges)
        (staging / CONFIG_FILE).write_text(config_text(config))
        target = repository / checkpoint.name
        _replace_folder(staging, target)
    return target
