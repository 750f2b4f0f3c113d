"""The model repository format, shared by the exporter (writes) and the server (reads).

    REPO/<model>/config.pbtxt          Triton ModelConfig, text format
    REPO/<model>/<version>/model.onnx  fp32 graph (Triton's default_model_filename)
    REPO/<model>/<version>/model.int8.onnx, model.fp16.onnx   other variants, when published
    REPO/<model>/tokenizer.json ...    tokenizer files, when the model takes text
    REPO/<model>/parity.json           the parity gate's figures
    REPO/<model>/fidelity.npz          gate inputs and the model's fp32 embeddings (checked at load)
    REPO/<model>/embedding_ranges.npz  per-dimension [min, max] of the embedding over a calibration corpus,
                                       for each served width (int8/uint8 embeddings), when the model has them

A two-tower model (CLIP, SigLIP) also holds its image graphs (a variant each), their fidelity reference and its
preprocessor config: service.core.towers.

Serving facts that Triton has no field for live in `parameters` (string values).
`optimization.graph.level` is Triton's own field, read as Triton's ONNX Runtime backend reads it:
ONNX Runtime's online graph optimisation for the fp32 graph (see `ModelSpec.graph_optimization`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf import text_format

from protocol import model_config_pb2 as mc
from service.core.sources import parse_model_argument
from service.core.text_rules import MULTIVECTOR_SCORES, PAIR_FIELDS, PAIR_PLACEHOLDER, MultiVectorSpec, PairTemplate
from service.core.towers import (
    IMAGE_FIDELITY_FILE,
    P_IMAGE_PREPROCESSOR,
    P_IMAGE_VARIANT_PREFIX,
    P_TEXT_PADDING,
    TOWER_POOLINGS,
    tower_facts,
)

if TYPE_CHECKING:
    from service.ops.settings import Settings

CONFIG_FILE = "config.pbtxt"
PARITY_FILE = "parity.json"
FIDELITY_FILE = "fidelity.npz"
EMBEDDING_RANGES_FILE = "embedding_ranges.npz"
PLATFORM = "onnxruntime_onnx"
VARIANT_FILES = {"fp32": "model.onnx", "int8": "model.int8.onnx", "fp16": "model.fp16.onnx"}
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
ADAPTER_IDS = "adapter_ids"
"""A graph input of a model with task adapters (jina-embeddings-v3): INT64 [batch, sequence], each token's task
adapter, 1 + the task's place in the tasks parameter (0: none); the server gives every token of a text its
task's id."""
TOKEN_VECTORS = "token_vectors"
"""A multi-vector model's graph output: [batch, sequence, width], each position's L2-normalised vector
(which positions belong to a text is the multivector parameter's rule, applied by the server)."""
TOKEN_WEIGHTS = "token_weights"
"""bge-m3's sparse head: [batch, sequence, 1], each position's weight (0 for special tokens and padding); a
text's term weight is the largest weight of its id. Per position like last_hidden_state, so batches cut it
at each row's end the same way."""
TASK_OUTPUTS = {
    "embed": ("last_hidden_state", "embedding"),
    "classify": ("logits",),
    "sparse": ("sparse_embedding",),
    "multivector": (TOKEN_VECTORS,),
}
"""Each task and the outputs its graphs answer: vectors, a classifier's raw logits, a SPLADE model's
sparse embedding (a weight per vocabulary id, most of them 0), or a ColBERT model's token vectors."""
EXTRA_OUTPUTS = {"embed": (TOKEN_VECTORS, TOKEN_WEIGHTS)}
"""Outputs a task's graph may answer besides its own: bge-m3's multi-vector and sparse heads on an embedder."""
TASK_VECTORS = {"embed": "embedding", "classify": "logits", "sparse": "sparse_embedding", "multivector": TOKEN_VECTORS}
"""Each task's output whose last dimension config.pbtxt declares as its width."""
POOLING_MODES = ("mean", "cls", "max", "lasttoken")

# Parameter keys (config.pbtxt `parameters`).
P_MAX_SEQUENCE_LENGTH = "max_sequence_length"
P_VOCAB_SIZE = "vocab_size"
P_TYPE_VOCAB_SIZE = "type_vocab_size"
P_POOLING = "pooling"
P_NORMALIZE = "normalize"
P_POOLED_PROJECTION = "pooled_projection"
POOLED_PROJECTIONS = ("", "dense")
"""What maps an embedder's pooled vector before normalisation ("dense": sentence-transformers' Dense modules);
absent: nothing, the embedding is the pooled token states."""
P_TOKENIZER = "tokenizer"
P_PAD_TOKEN_ID = "pad_token_id"
P_MODEL_TYPE = "model_type"
P_TASK = "task"
P_LABELS = "labels"
P_PROMPTS = "prompts"
P_DEFAULT_PROMPT_NAME = "default_prompt_name"
P_ADAPTER_TASKS = "adapter_tasks"
"""JSON list: the task adapters' names; a task's id in adapter_ids is 1 + its place (0: no adapter)."""
P_SIMILARITY_FN_NAME = "similarity_fn_name"
P_MATRYOSHKA_DIMENSIONS = "matryoshka_dimensions"
P_EMBEDDING_RANGES = "embedding_ranges"
"""The file of the embedding's calibrated ranges (EMBEDDING_RANGES_FILE); absent: none were calibrated."""
P_EMBEDDING_CALIBRATION = "embedding_calibration"
"""What the ranges were calibrated on (a corpus and its size), as reported to clients."""
P_MULTIVECTOR = "multivector"
"""JSON object: how a multi-vector model's texts are tokenised and which positions' vectors are theirs
(MultiVectorSpec's fields); required with output token_vectors."""
GRAPH_LEVELS = {-1: "basic", 0: "all", 1: "extended", 2: "disabled"}
"""Triton's `optimization.graph.level` values and the ONNX Runtime online optimisation each stands for."""
P_PAIR_TEMPLATE = "pair_template"
"""JSON object: how a reranker that reads a prompt (Qwen3-Reranker) makes one sequence of a (query, document)
pair (PairTemplate's fields); absent: the tokenizer's own pair form ([CLS] q [SEP] d [SEP])."""
P_VARIANT_PREFIX = "variant."
P_PREFERRED_PREFIX = "preferred_variant."


class RepositoryError(ValueError):
    """A model folder that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the server needs to know about one model, read from its folder."""

    name: str
    version: str
    directory: Path
    config: mc.ModelConfig
    variants: dict[str, Path]
    """Published variants (fp32/int8/fp16) -> ONNX file."""
    preferred_variants: dict[str, str]
    """Execution device (cpu/cuda) -> the variant measured best there."""
    input_names: tuple[str, ...]
    """Token inputs of the graph, in config order."""
    max_sequence_length: int
    vocab_size: int
    type_vocab_size: int
    """Segment ids accepted in token_type_ids (0 when the graph has no such input)."""
    hidden_size: int
    """Width of the embedding (0 for a classifier or a sparse embedder)."""
    pad_token_id: int
    tokenizer_file: Path | None
    """tokenizer.json, when the model accepts text."""
    fidelity_file: Path | None = None
    """fidelity.npz (reference inputs and embeddings for the check at load); None in older repositories."""
    task: str = "embed"
    """embed (an embedding model), classify (a reranker or classifier: logits out) or sparse (SPLADE:
    sparse_embedding out, [vocab_size] per text)."""
    labels: tuple[str, ...] = ()
    """A classifier's labels in id order (its logits' width)."""
    model_type: str = ""
    """The source's architecture, as reported ("" when the repository does not say)."""
    pooling: str = "mean"
    normalize: bool = True
    pooled_projection: str = ""
    """What maps the pooled vector before normalisation ("dense"); "" nothing (late chunking pools as the graph)."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Prompt name -> the prefix put before a text (sentence-transformers' prompts)."""
    default_prompt_name: str = ""
    """The prompt applied when a request names none ("" none)."""
    similarity_fn_name: str = ""
    matryoshka_dimensions: tuple[int, ...] = ()
    """Widths the embedding may be shortened to (it was trained for them)."""
    embedding_ranges: dict[int, np.ndarray] = field(default_factory=dict)
    """Served width -> float32 [2, width]: each dimension's minimum and maximum over the export's calibration
    corpus (what int8/uint8 embeddings are scaled by); empty when the repository has none."""
    multivector: MultiVectorSpec | None = None
    """A multi-vector model's rules (task multivector, or an embedder with token_vectors); None otherwise."""
    multivector_width: int = 0
    """Width of each token vector (0 without token_vectors)."""
    pair_template: PairTemplate | None = None
    """How a reranker that reads a prompt pairs a query and a document; None: the tokenizer's own pair form."""
    adapter_tasks: tuple[str, ...] = ()
    """The task adapters' names (jina-embeddings-v3's retrieval.query …): task i's id in adapter_ids is i + 1;
    empty: the model has none."""
    graph_outputs: tuple[str, ...] = ()
    """The graph's outputs as config.pbtxt lists them (the task's own, then any extra heads')."""
    image_variants: dict[str, Path] = field(default_factory=dict)
    """A two-tower model's image graphs (variant -> ONNX file: pixel_values -> embedding); empty: no image tower."""
    image_preprocessor: Path | None = None
    """A two-tower model's preprocessor_config.json (service.pipeline.images)."""
    image_fidelity_file: Path | None = None
    """A two-tower model's image_fidelity.npz (the image graph's check at load); None in older repositories."""
    text_padding: str = "longest"
    """How a batch of texts is padded (service.core.towers.TEXT_PADDINGS)."""
    graph_optimization: str = "all"
    """ONNX Runtime's online graph optimisation for the fp32 graph on the CPU (`optimization.graph.level`).

    The exporter writes basic: its fp32 file already is the graph form it timed fastest, which the
    higher levels' own fusions would rewrite into a slower one
    (docs/decisions.md#fp32-graph-at-basic-optimisation)."""

    def online_optimization(self, variant: str, device: str) -> str:
        """The online graph optimisation a variant runs at on a device (cpu/cuda)."""
        return online_optimization(variant, device, self.graph_optimization)

    @property
    def max_batch_size(self) -> int:
        """Largest number of sequences one request or batch may hold."""
        return self.config.max_batch_size

    @property
    def output_names(self) -> tuple[str, ...]:
        """The graph's outputs: the task's own, then any extra heads' (bge-m3's)."""
        return self.graph_outputs or TASK_OUTPUTS[self.task]

    def output_shape(self, name: str, rows: int, length: int) -> tuple[int, ...]:
        """An output's shape for a batch of rows x length tokens."""
        shapes = {
            "embedding": (rows, self.hidden_size),
            "last_hidden_state": (rows, length, self.hidden_size),
            "logits": (rows, len(self.labels)),
            "sparse_embedding": (rows, self.vocab_size),
            TOKEN_VECTORS: (rows, length, self.multivector_width),
            TOKEN_WEIGHTS: (rows, length, 1),
        }
        return shapes[name]

    @property
    def uses_segments(self) -> bool:
        """Whether the graph takes token_type_ids."""
        return "token_type_ids" in self.input_names

    def adapter_id(self, task: str) -> int:
        """A task adapter's id in adapter_ids (a ValueError for a task the model has not)."""
        return self.adapter_tasks.index(task) + 1


def online_optimization(variant: str, device: str, fp32_on_cpu: str) -> str:
    """The online graph optimisation a variant runs at on a device, given the fp32 graph's on the CPU.

    The config's level holds for the fp32 graph on the CPU, where its form was chosen; elsewhere
    all: the int8 graph's quantised MatMuls and the fp16 graph's CUDA kernels rely on the online fusions.
    """
    return fp32_on_cpu if variant == "fp32" and device == "cpu" else "all"


def config_text(config: mc.ModelConfig) -> str:
    """Serialise a ModelConfig as config.pbtxt text."""
    return text_format.MessageToString(config)


def parse_config(text: str, source: Path) -> mc.ModelConfig:
    """Parse config.pbtxt text; fields this project does not model are ignored."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config, allow_unknown_field=True)
    except text_format.ParseError as error:
        raise RepositoryError(f"{source}: {error}") from error
    return config


def _parameter(config: mc.ModelConfig, key: str, source: Path, default: str | None = None) -> str:
    if key in config.parameters:
        return config.parameters[key].string_value
    if default is None:
        raise RepositoryError(f"{source}: parameter {key!r} is missing")
    return default


def _int_parameter(config: mc.ModelConfig, key: str, source: Path, default: str | None = None) -> int:
    value = _parameter(config, key, source, default)
    try:
        number = int(value)
    except ValueError as error:
        raise RepositoryError(f"{source}: parameter {key!r} is not an integer: {value!r}") from error
    if number < 0:
        raise RepositoryError(f"{source}: parameter {key!r} is negative")
    return number


def latest_version(directory: Path) -> str:
    """The highest numeric version folder (Triton's default version policy)."""
    versions = [p.name for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
    if not versions:
        raise RepositoryError(f"{directory}: no numeric version folder")
    return max(versions, key=int)


def _check_signature(config: mc.ModelConfig, source: Path, task: str, two_tower: bool) -> tuple[tuple, int, int]:
    """Validate inputs/outputs (two towers: embedding only); token inputs, the output's width, token vectors'."""
    names = tuple(i.name for i in config.input)
    if names[:2] != TOKEN_INPUTS[:2] or not set(names) <= {*TOKEN_INPUTS, ADAPTER_IDS}:
        raise RepositoryError(
            f"{source}: inputs must be input_ids, attention_mask[, token_type_ids][, {ADAPTER_IDS}]; got {names}"
        )
    for tensor in config.input:
        if tensor.data_type != mc.TYPE_INT64 or list(tensor.dims) != [-1]:
            raise RepositoryError(f"{source}: input {tensor.name} must be TYPE_INT64 with dims [-1]")
    outputs = {o.name: o for o in config.output}
    expected, extra = (("embedding",), ()) if two_tower else (TASK_OUTPUTS[task], EXTRA_OUTPUTS.get(task, ()))
    if not set(expected) <= set(outputs) or not set(outputs) <= {*expected, *extra}:
        also = f" (and optionally {', '.join(extra)})" if extra else ""
        raise RepositoryError(
            f"{source}: a {task} model's outputs must be {', '.join(expected)}{also}; got {sorted(outputs)}"
        )
    vector = TASK_VECTORS[task]
    dims = list(outputs[vector].dims)
    if (len(dims) != 2 or dims[0] != -1) if vector == TOKEN_VECTORS else len(dims) != 1:
        dims = [0]
    if dims[-1] <= 0:
        width = {
            "embed": "[hidden_size]",
            "classify": "[labels]",
            "sparse": "[vocab_size]",
            "multivector": "[-1, width]",
        }
        raise RepositoryError(f"{source}: output {vector} must have dims {width[task]}")
    token_vectors = outputs.get(TOKEN_VECTORS)
    if token_vectors is not None and (
        len(token_vectors.dims) != 2 or token_vectors.dims[0] != -1 or token_vectors.dims[1] <= 0
    ):
        raise RepositoryError(f"{source}: output {TOKEN_VECTORS} must have dims [-1, width]")
    if TOKEN_WEIGHTS in outputs and list(outputs[TOKEN_WEIGHTS].dims) != [-1, 1]:
        raise RepositoryError(f"{source}: output {TOKEN_WEIGHTS} must have dims [-1, 1]")
    return names, dims[-1], token_vectors.dims[1] if token_vectors is not None else 0


def _json_parameter(config: mc.ModelConfig, key: str, source: Path, kind: type) -> object:
    """A parameter holding JSON of the given kind (absent: an empty one)."""
    text = _parameter(config, key, source, "")
    if not text:
        return kind()
    try:
        value = json.loads(text)
    except ValueError as error:
        raise RepositoryError(f"{source}: parameter {key!r} is not JSON: {error}") from error
    if not isinstance(value, kind):
        raise RepositoryError(f"{source}: parameter {key!r} must be a JSON {kind.__name__}")
    return value


def range_key(width: int) -> str:
    """The array name of one width's ranges in EMBEDDING_RANGES_FILE."""
    return f"width_{width}"


def write_embedding_ranges(path: Path, ranges: dict[int, np.ndarray]) -> None:
    """Save calibrated ranges (width -> [2, width] minimum and maximum) as EMBEDDING_RANGES_FILE."""
    np.savez(path, **{range_key(width): np.asarray(array, dtype=np.float32) for width, array in ranges.items()})


def _embedding_ranges(config: mc.ModelConfig, directory: Path, source: Path, widths: tuple[int, ...]) -> dict:
    """The calibrated ranges of every served width, checked; {} when the repository names no ranges file."""
    name = _parameter(config, P_EMBEDDING_RANGES, source, "")
    if not name:
        return {}
    path = _inside(directory, name, source)
    try:
        with np.load(path) as stored:
            arrays = {key: stored[key] for key in stored.files}
    except (OSError, ValueError) as error:
        raise RepositoryError(f"{source}: embedding ranges file {path} is unreadable ({error})") from error
    ranges = {}
    for width in widths:
        array = arrays.get(range_key(width))
        if array is None or array.shape != (2, width) or array.dtype != np.float32:
            raise RepositoryError(f"{path}: needs {range_key(width)}, float32 of shape [2, {width}]")
        if not np.isfinite(array).all() or (array[0] > array[1]).any():
            raise RepositoryError(f"{path}: {range_key(width)} must hold finite minimums not above their maximums")
        ranges[width] = array
    return ranges


def _task_facts(config: mc.ModelConfig, source: Path, task: str, width: int, two_tower: bool) -> dict[str, object]:
    """The task's own parameters, checked: labels, prompts, pooling, Matryoshka widths (as the task has them)."""
    if task == "classify":
        labels = _json_parameter(config, P_LABELS, source, list)
        if len(labels) != width or not all(isinstance(label, str) for label in labels):
            raise RepositoryError(f"{source}: parameter labels must name the {width} labels of output logits")
        return {"labels": tuple(labels)}
    prompts = _json_parameter(config, P_PROMPTS, source, dict)
    if not all(isinstance(text, str) for text in prompts.values()):
        raise RepositoryError(f"{source}: parameter prompts must map names to strings")
    default_prompt = _parameter(config, P_DEFAULT_PROMPT_NAME, source, "")
    if default_prompt and default_prompt not in prompts:
        raise RepositoryError(f"{source}: default_prompt_name {default_prompt!r} is not one of the prompts")
    if task == "multivector":
        return {"prompts": prompts, "default_prompt_name": default_prompt}
    if task == "sparse":
        vocab_size = _int_parameter(config, P_VOCAB_SIZE, source)
        if width != vocab_size:
            raise RepositoryError(f"{source}: output sparse_embedding has dims [{width}], vocab_size is {vocab_size}")
        return {"prompts": prompts, "default_prompt_name": default_prompt}
    pooling = _parameter(config, P_POOLING, source, "mean")
    projection = _parameter(config, P_POOLED_PROJECTION, source, "")
    if projection not in POOLED_PROJECTIONS:
        raise RepositoryError(f"{source}: pooled_projection {projection!r} is not one of {POOLED_PROJECTIONS}")
    poolings = TOWER_POOLINGS if two_tower else POOLING_MODES
    if pooling not in poolings:
        raise RepositoryError(f"{source}: pooling {pooling!r} is not one of {', '.join(poolings)}")
    dimensions = _json_parameter(config, P_MATRYOSHKA_DIMENSIONS, source, list)
    if not all(type(d) is int and 0 < d <= width for d in dimensions):
        raise RepositoryError(f"{source}: matryoshka_dimensions must be widths within 1..{width}")
    matryoshka = tuple(sorted(set(dimensions), reverse=True))
    return {
        "pooling": pooling,
        "normalize": _parameter(config, P_NORMALIZE, source, "true") == "true",
        "pooled_projection": projection,
        "prompts": prompts,
        "default_prompt_name": default_prompt,
        "similarity_fn_name": _parameter(config, P_SIMILARITY_FN_NAME, source, ""),
        "matryoshka_dimensions": matryoshka,
        "embedding_ranges": _embedding_ranges(config, source.parent, source, (width, *matryoshka)),
    }


def _adapter_tasks(config: mc.ModelConfig, source: Path, input_names: tuple[str, ...]) -> tuple[str, ...]:
    """The adapter_tasks parameter, checked: present exactly when the graph takes adapter_ids, distinct names."""
    tasks = _json_parameter(config, P_ADAPTER_TASKS, source, list)
    if bool(tasks) != (ADAPTER_IDS in input_names):
        raise RepositoryError(f"{source}: input {ADAPTER_IDS} and parameter {P_ADAPTER_TASKS} go together")
    if not all(isinstance(task, str) and task for task in tasks) or len(set(tasks)) != len(tasks):
        raise RepositoryError(f"{source}: parameter {P_ADAPTER_TASKS} must list distinct task names")
    return tuple(tasks)


def _multivector(config: mc.ModelConfig, source: Path) -> MultiVectorSpec:
    """The multivector parameter, checked field by field."""
    fields = _json_parameter(config, P_MULTIVECTOR, source, dict)
    if not fields:
        raise RepositoryError(f"{source}: parameter {P_MULTIVECTOR!r} is missing (output {TOKEN_VECTORS} needs it)")
    known = {f.name: f for f in dataclasses.fields(MultiVectorSpec)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise RepositoryError(f"{source}: parameter {P_MULTIVECTOR!r} has unknown fields {', '.join(unknown)}")

    def bad(name: str, what: str) -> RepositoryError:
        return RepositoryError(f"{source}: parameter {P_MULTIVECTOR!r}: {name} must be {what}")

    for name in ("query_prefix_id", "document_prefix_id", "query_length", "document_length", "query_expansion_id"):
        value = fields.get(name)
        if value is not None and (type(value) is not int or value < 0):
            raise bad(name, "a non-negative integer or null")
    for name in ("query_length", "document_length"):
        if fields.get(name) is not None and fields[name] < 3:
            raise bad(name, "at least 3 tokens")
    for name in ("skip_first_token", "attend_to_expansion_tokens"):
        if type(fields.get(name, False)) is not bool:
            raise bad(name, "true or false")
    if fields.get("score", "sum") not in MULTIVECTOR_SCORES:
        raise bad("score", " or ".join(MULTIVECTOR_SCORES))
    skip_ids = fields.get("document_skip_ids", [])
    if not isinstance(skip_ids, list) or not all(type(i) is int and i >= 0 for i in skip_ids):
        raise bad("document_skip_ids", "a list of token ids")
    fields["document_skip_ids"] = tuple(skip_ids)
    return MultiVectorSpec(**fields)


def _pair_template(config: mc.ModelConfig, source: Path, task: str, width: int) -> PairTemplate | None:
    """The pair_template parameter, checked: a reranker's (one logit), its fields strings, each placeholder once."""
    fields = _json_parameter(config, P_PAIR_TEMPLATE, source, dict)
    if not fields:
        return None
    where = f"{source}: parameter {P_PAIR_TEMPLATE!r}"
    if task != "classify" or width != 1:
        raise RepositoryError(f"{where} belongs to a reranker (task classify, one label), not this {task} model")
    names = [f.name for f in dataclasses.fields(PairTemplate)]
    if sorted(fields) != sorted(names) or not all(isinstance(value, str) for value in fields.values()):
        raise RepositoryError(f"{where} must hold exactly {', '.join(names)}, each a string")
    found = PAIR_PLACEHOLDER.findall(fields["middle"])
    if sorted(found) != sorted(PAIR_FIELDS):
        placeholders = ", ".join("{" + name + "}" for name in PAIR_FIELDS)
        raise RepositoryError(f"{where}: middle must hold {placeholders} once each, it holds {found}")
    return PairTemplate(**fields)


def _inside(folder: Path, name: str, source: Path) -> Path:
    """folder/name, where name (from config.pbtxt) is a relative path that stays inside folder."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise RepositoryError(f"{source}: file {name!r} must be a path inside the model's folder")
    return folder / name


def _variant_files(config: mc.ModelConfig, version: Path, source: Path, prefix: str) -> dict[str, Path]:
    """The graphs parameters named prefix + variant name (variant -> file in the version folder), each present."""
    files = {
        key[len(prefix) :]: _inside(version, value.string_value, source)
        for key, value in config.parameters.items()
        if key.startswith(prefix)
    }
    for variant, path in files.items():
        if not path.is_file():
            raise RepositoryError(f"{source}: {prefix}{variant} file {path} does not exist")
    return files


def _tower_facts(config: mc.ModelConfig, directory: Path, source: Path, task: str, image_variants: dict) -> dict:
    """A two-tower model's image graphs, preprocessor and text padding (service.core.towers); {} for others."""
    if not image_variants:
        return {}
    preprocessor = _inside(directory, _parameter(config, P_IMAGE_PREPROCESSOR, source), source)
    try:
        padding = _parameter(config, P_TEXT_PADDING, source, "longest")
        return tower_facts(task, image_variants, preprocessor, padding, directory / IMAGE_FIDELITY_FILE)
    except ValueError as error:
        raise RepositoryError(f"{source}: {error}") from error


def read_model(directory: Path) -> ModelSpec:
    """Read and validate one model folder of a repository."""
    source = directory / CONFIG_FILE
    if not source.is_file():
        raise RepositoryError(f"{directory}: no {CONFIG_FILE}")
    config = parse_config(source.read_text(), source)
    if config.name and config.name != directory.name:
        raise RepositoryError(f"{source}: name {config.name!r} differs from its folder {directory.name!r}")
    config.name = directory.name
    if config.platform not in ("", PLATFORM) or config.backend not in ("", "onnxruntime"):
        raise RepositoryError(f"{source}: platform must be {PLATFORM}")
    if config.max_batch_size <= 0:
        raise RepositoryError(f"{source}: max_batch_size must be positive")
    task = _parameter(config, P_TASK, source, "embed")
    if task not in TASK_OUTPUTS:
        raise RepositoryError(f"{source}: task {task!r} is not one of {', '.join(TASK_OUTPUTS)}")
    version = latest_version(directory)
    image_variants = _variant_files(config, directory / version, source, P_IMAGE_VARIANT_PREFIX)
    two_tower = bool(image_variants)
    input_names, width, multivector_width = _check_signature(config, source, task, two_tower)
    graph_outputs = tuple(output.name for output in config.output)
    variants = _variant_files(config, directory / version, source, P_VARIANT_PREFIX) or {
        "fp32": _inside(directory / version, config.default_model_filename or VARIANT_FILES["fp32"], source)
    }
    if not variants["fp32"].is_file():
        raise RepositoryError(f"{source}: variant fp32 file {variants['fp32']} does not exist")
    preferred = {
        key[len(P_PREFERRED_PREFIX) :]: value.string_value
        for key, value in config.parameters.items()
        if key.startswith(P_PREFERRED_PREFIX)
    }
    for device, variant in preferred.items():
        if variant not in variants:
            raise RepositoryError(f"{source}: preferred variant {variant!r} for {device} is not published")
    level = config.optimization.graph.level
    if level not in GRAPH_LEVELS:
        named = ", ".join(f"{value} ({name})" for value, name in GRAPH_LEVELS.items())
        raise RepositoryError(f"{source}: optimization.graph.level {level} is not one of {named}")
    tokenizer_name = _parameter(config, P_TOKENIZER, source, "")
    tokenizer_file = _inside(directory, tokenizer_name, source) if tokenizer_name else None
    if tokenizer_file is not None and not tokenizer_file.is_file():
        raise RepositoryError(f"{source}: tokenizer file {tokenizer_file} does not exist")
    return ModelSpec(
        name=directory.name,
        version=version,
        directory=directory,
        config=config,
        variants=variants,
        preferred_variants=preferred,
        input_names=input_names,
        max_sequence_length=_int_parameter(config, P_MAX_SEQUENCE_LENGTH, source),
        vocab_size=_int_parameter(config, P_VOCAB_SIZE, source),
        type_vocab_size=_int_parameter(
            config, P_TYPE_VOCAB_SIZE, source, "2" if "token_type_ids" in input_names else "0"
        ),
        hidden_size=width if task == "embed" else 0,
        pad_token_id=_int_parameter(config, P_PAD_TOKEN_ID, source, "0"),
        tokenizer_file=tokenizer_file,
        fidelity_file=directory / FIDELITY_FILE if (directory / FIDELITY_FILE).is_file() else None,
        task=task,
        model_type=_parameter(config, P_MODEL_TYPE, source, ""),
        graph_optimization=GRAPH_LEVELS[level],
        multivector=_multivector(config, source) if multivector_width else None,
        multivector_width=multivector_width,
        pair_template=_pair_template(config, source, task, width),
        graph_outputs=graph_outputs,
        adapter_tasks=_adapter_tasks(config, source, input_names),
        **_tower_facts(config, directory, source, task, image_variants),
        **_task_facts(config, source, task, width, two_tower),
    )


def model_directories(root: Path) -> list[Path]:
    """Model folders of a repository: the sub-folders holding a config.pbtxt, by name.

    Hidden folders are not models: a publish interrupted between its renames leaves the model it
    replaced as `.retired-<name>-...`, and editors and `kubectl cp` leave their own.
    """
    if not root.is_dir():
        raise RepositoryError(f"model repository {root} is not a directory")
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / CONFIG_FILE).is_file())


def served_names(settings: Settings) -> list[str]:
    """The models a server serves: its repository's folders (when it serves one), then those given by name (--model).

    RepositoryError when a name is both.
    """
    names = [d.name for d in model_directories(settings.model_repository)] if settings.serves_repository else []
    for text in settings.model:
        name = parse_model_argument(text).name
        if name in names:
            raise RepositoryError(f"model {name} is in {settings.model_repository} and given by --model: rename one")
        names.append(name)
    return names
