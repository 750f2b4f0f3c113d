"""What a sentence-transformers folder declares, checked against what the exporter implements.

`modules.json` lists the modules `SentenceTransformer`, `CrossEncoder` or `SparseEncoder` chains;
each module's own file configures it, and `config_sentence_transformers.json` says which class
made the folder. The exporter implements these chains: a Transformer at the folder root, then (for
an embedder) one Pooling module, any number of Dense modules (export.heads.dense: EmbeddingGemma's
projection) and optionally a Normalize module last; a CrossEncoder's
Transformer alone; a SparseEncoder's (MLM)Transformer (fill-mask) then SpladePooling (SPLADE); PyLate's
ColBERT: a Transformer then PyLate's Dense (config_sentence_transformers.json model_type "ColBERT", or none).
A two-tower model's folder (CLIP, SigLIP) is read by export.checkpoints.two_tower_folder.
A folder whose modules include SpladePooling is a sparse embedder, one with PyLate's Dense a ColBERT
model. Every other module type, and
every declared field that would change the outputs and that the exporter does not implement,
refuses the export with one line naming the file and field: a folder is never approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRANSFORMER_TYPES = (
    "sentence_transformers.models.Transformer",  # sentence-transformers 2 to 5.3
    "sentence_transformers.base.modules.transformer.Transformer",  # 5.4 on
)
POOLING_TYPES = (
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
)
NORMALIZE_TYPES = (
    "sentence_transformers.models.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",  # 5.4 to 5.x
    "sentence_transformers.base.modules.normalize.Normalize",  # 6 on
)
MLM_TRANSFORMER_TYPES = (
    "sentence_transformers.sparse_encoder.models.MLMTransformer",  # 5.0 to 5.3
    "sentence_transformers.sparse_encoder.modules.MLMTransformer",
    "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer",  # 5.4 on
)
SPLADE_POOLING_TYPES = (
    "sentence_transformers.sparse_encoder.models.SpladePooling",
    "sentence_transformers.sparse_encoder.modules.SpladePooling",
    "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling",
)
DENSE_TYPES = (
    "sentence_transformers.models.Dense",  # sentence-transformers 2 to 5.x (EmbeddingGemma's folder)
    "sentence_transformers.base.modules.dense.Dense",  # 6 on
)
"""sentence-transformers' Dense (a linear map of the pooled embedding): accepted after an embedder's Pooling."""
PYLATE_DENSE_TYPES = ("pylate.models.Dense.Dense",)
"""PyLate's Dense (a ColBERT model's projection): accepted in a ColBERT folder only."""
PYLATE_DENSE_FIELDS = {"in_features", "out_features", "bias", "activation_function", "use_residual"}
"""A PyLate Dense config.json's fields (export.heads.colbert reads and checks each)."""
COLBERT_FIELDS = {
    "query_prefix",
    "document_prefix",
    "query_length",
    "document_length",
    "attend_to_expansion_tokens",
    "skiplist_words",
    "do_query_expansion",
}
"""config_sentence_transformers.json fields of a ColBERT folder (PyLate's; export.heads.colbert reads each)."""
MODULE_KINDS = (
    {name: "Transformer" for name in TRANSFORMER_TYPES}
    | {name: "Pooling" for name in POOLING_TYPES}
    | {name: "Normalize" for name in NORMALIZE_TYPES}
    | {name: "MLMTransformer" for name in MLM_TRANSFORMER_TYPES}
    | {name: "SpladePooling" for name in SPLADE_POOLING_TYPES}
    | {name: "Dense" for name in DENSE_TYPES}
)
"""modules.json `type` -> the module it names, for every type name a sentence-transformers release writes."""
CHAIN_KINDS = MODULE_KINDS | {name: "PyLateDense" for name in PYLATE_DENSE_TYPES}
"""modules.json `type` -> the module it names, sentence-transformers' and PyLate's."""
SUPPORTED_CHAIN = (
    "supported: sentence-transformers' Transformer at the folder root, then Pooling, then any Dense modules"
    " (identity activation), then optionally Normalize last;"
    " or a CrossEncoder's Transformer alone; or a SparseEncoder's MLMTransformer then SpladePooling;"
    " or PyLate's ColBERT: a Transformer then PyLate's Dense"
)
POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
"""sentence-transformers' Pooling switches before version 5.4 -> our pooling modes."""
POOLING_MODES = tuple(POOLING_KEYS.values())
POOLING_FIELDS = {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt"}
"""Pooling config.json fields besides the pooling_mode_* switches."""
SPLADE_POOLING_FIELDS = {"pooling_strategy", "activation_function", "embedding_dimension", "word_embedding_dimension"}
SPLADE_POOLING_SPEED_FIELDS = {"chunk_size"}
"""SpladePooling fields that change only how much is computed at once (max and sum over chunks are the same)."""
TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
"""The Transformer module's config file, under each name sentence-transformers reads (the first present counts)."""
TASKS = {
    "embed": {
        "noun": "an embedder",
        "model_type": "SentenceTransformer",
        "transformer_task": "feature-extraction",
        "method_output_name": "last_hidden_state",
        "module_output_name": "token_embeddings",
    },
    "classify": {
        "noun": "a reranker or classifier",
        "model_type": "CrossEncoder",
        "transformer_task": "sequence-classification",
        "method_output_name": "logits",
        "module_output_name": "scores",
    },
    "sparse": {
        "noun": "a sparse embedder (SPLADE)",
        "model_type": "SparseEncoder",
        "transformer_task": "fill-mask",
        "method_output_name": "logits",
        "module_output_name": "token_embeddings",
    },
    "multivector": {
        "noun": "a ColBERT multi-vector model (PyLate)",
        "model_type": "ColBERT",
        "transformer_task": "feature-extraction",
        "method_output_name": "last_hidden_state",
        "module_output_name": "token_embeddings",
    },
}
"""What each task's sentence-transformers files say where they say it."""
LOADING_ARGUMENTS = (
    "model_args",
    "model_kwargs",
    "tokenizer_args",
    "processor_kwargs",
    "config_args",
    "config_kwargs",
    "processing_kwargs",
)
"""Transformer config fields that change how the model or its tokenizer is loaded or called: only empty ones pass."""
MULTI_VECTOR_FIELDS = ("query_length", "document_length", "query_expansion")
"""Transformer config fields of multi-vector models: only null ones pass."""
MODEL_CONFIG_FIELDS = {
    "__version__",
    "model_type",
    "prompts",
    "default_prompt_name",
    "similarity_fn_name",
    "truncate_dim",
    "requirements",
    "activation_fn",  # CrossEncoder.predict's default activation: the published output is the raw logits
    "keep_in_fp32_modules",  # CrossEncoder's precision when loaded in half precision
}
"""config_sentence_transformers.json fields the exporter reads or knows not to change the outputs."""


class FolderError(ValueError):
    """A sentence-transformers declaration the exporter does not implement; the message names its file and field."""


@dataclass(frozen=True)
class Declarations:
    """What a folder's sentence-transformers files declare for the encoder, checked."""

    pooling: str = "mean"
    """mean, cls, max or lasttoken (mean where modules.json is absent, as sentence-transformers builds it)."""
    pooling_dimension: int | None = None
    """The Pooling module's embedding dimension; None: no Pooling module declares one."""
    pooling_file: Path | None = None
    """The Pooling module's config.json (named in messages)."""
    normalize: bool = True
    """Whether a Normalize module ends the chain (the exporter normalises a folder without modules.json)."""
    max_seq_length: int | None = None
    """The Transformer module's max_seq_length, else the tokenizer's model_max_length (None: neither declares one)."""
    model_config: dict | None = None
    """config_sentence_transformers.json, checked (None: absent)."""
    splade_pooling: tuple[str, str] | None = None
    """A sparse embedder's SpladePooling: (pooling_strategy, activation_function); None: not a sparse embedder."""
    splade_dimension: int | None = None
    """The SpladePooling module's embedding dimension (None: not declared); the vocabulary's size if declared."""
    dense: dict | None = None
    """A ColBERT model's PyLate Dense config.json (its fields checked by export.heads.colbert); None: not ColBERT."""
    dense_folder: Path | None = None
    """The PyLate Dense module's folder (its weights)."""
    pooled_dense: tuple[tuple[Path, dict], ...] = ()
    """An embedder's sentence-transformers Dense modules after Pooling, in order: (folder, config.json fields)."""


def _read_json(path: Path) -> object:
    """A JSON file's content; a malformed file is one line naming it."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise FolderError(f"{path}: malformed JSON ({error})") from error


def read_object(path: Path) -> dict:
    """A JSON file holding an object; anything else is one line naming the file."""
    content = _read_json(path)
    if not isinstance(content, dict):
        raise FolderError(f"{path}: not a JSON object")
    return content


def module_list(path: Path) -> list[tuple[str, str]]:
    """(type, path) of every module modules.json lists, in order."""
    entries = _read_json(path)
    if not isinstance(entries, list) or not entries:
        raise FolderError(f"{path}: not a list of modules")
    modules = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(key), str) for key in ("type", "path")):
            raise FolderError(f"{path}: module {index} lacks a type or a path")
        modules.append((entry["type"], entry["path"]))
    return modules


def _check_chain(path: Path, modules: list[tuple[str, str]], task: str) -> None:
    """Every module known, and in the one order the exporter implements."""
    unknown = [f"{kind!r} at path {where!r}" for kind, where in modules if kind not in CHAIN_KINDS]
    if unknown:
        raise FolderError(f"{path}: module type not implemented here: {', '.join(unknown)} ({SUPPORTED_CHAIN})")
    kinds = [CHAIN_KINDS[kind] for kind, _ in modules]
    (first_type, first_path), rest = modules[0], kinds[1:]
    if kinds[0] not in ("Transformer", "MLMTransformer"):
        raise FolderError(f"{path}: the first module is {first_type!r}, not a Transformer ({SUPPORTED_CHAIN})")
    if first_path not in ("", "."):
        raise FolderError(
            f"{path}: the Transformer module is at path {first_path!r}, not the folder root ({SUPPORTED_CHAIN})"
        )
    if task == "sparse":
        if kinds not in (["MLMTransformer", "SpladePooling"], ["Transformer", "SpladePooling"]):
            raise FolderError(
                f"{path}: modules {' -> '.join(kinds)}: a sparse embedder must be exactly an MLMTransformer"
                f" then SpladePooling ({SUPPORTED_CHAIN})"
            )
        return
    if task == "multivector":
        if kinds != ["Transformer", "PyLateDense"]:
            raise FolderError(
                f"{path}: modules {' -> '.join(kinds)}: a ColBERT model must be exactly a Transformer then PyLate's"
                f" Dense ({SUPPORTED_CHAIN})"
            )
        return
    if kinds[0] == "MLMTransformer":
        raise FolderError(f"{path}: an MLMTransformer without SpladePooling is not implemented ({SUPPORTED_CHAIN})")
    if task == "classify" and rest:
        raise FolderError(
            f"{path}: {', '.join(rest)} after a sequence-classification Transformer (config.json's architectures)"
            f" is not implemented ({SUPPORTED_CHAIN})"
        )
    body = rest[:-1] if rest[-1:] == ["Normalize"] else rest
    if task == "embed" and (body[:1] != ["Pooling"] or any(kind != "Dense" for kind in body[1:])):
        raise FolderError(
            f"{path}: modules {' -> '.join(kinds)}: an embedder must have exactly one Pooling after the Transformer,"
            f" then only Dense modules, and Normalize only as the last module ({SUPPORTED_CHAIN})"
        )


def module_folder(folder: Path, modules_file: Path, where: str) -> Path:
    """A module's folder, which must lie inside the model folder (it need not exist: Normalize has no files)."""
    target = (folder / where).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise FolderError(f"{modules_file}: module path {where!r} is outside {folder}")
    return target


def _pooling(path: Path) -> tuple[str, int | None]:
    """The one pooling mode and the embedding dimension a Pooling config.json declares."""
    settings = read_object(path)
    unknown = sorted(k for k in settings if k not in POOLING_FIELDS and not k.startswith("pooling_mode_"))
    if unknown:
        raise FolderError(f"{path}: Pooling field {unknown[0]!r} is not implemented here")
    if "pooling_mode" in settings:  # sentence-transformers 5.4 on: one name (or a list of them)
        declared = settings["pooling_mode"]
        modes = [declared] if isinstance(declared, str) else list(declared)
        chosen = [mode for mode in modes if mode in POOLING_MODES]
        other = [str(mode) for mode in modes if mode not in POOLING_MODES]
    else:  # earlier versions: a switch per mode
        chosen = [mode for key, mode in POOLING_KEYS.items() if settings.get(key)]
        switches = (k for k, v in settings.items() if k.startswith("pooling_mode_") and v)
        other = sorted(k for k in switches if k not in POOLING_KEYS)
    if other or len(chosen) != 1:
        raise FolderError(
            f"{path}: exactly one of {', '.join(POOLING_MODES)} pooling is supported,"
            f" got {', '.join(chosen + other) or 'none'}"
        )
    if not settings.get("include_prompt", True):
        raise FolderError(f"{path}: pooling that leaves out the prompt (include_prompt false) is not supported")
    dimension = settings.get("embedding_dimension", settings.get("word_embedding_dimension"))
    if dimension is not None and not isinstance(dimension, int):
        raise FolderError(f"{path}: embedding dimension {dimension!r} is not an integer")
    return chosen[0], dimension


def _splade_pooling(path: Path) -> tuple[str, str, int | None]:
    """A SpladePooling config.json: its pooling strategy, activation and declared dimension, as written.

    Which strategies and activations are implemented is the model's to say (export.heads.splade): here,
    fields that would change the outputs and are unknown are refused.
    """
    settings = read_object(path)
    unknown = sorted(set(settings) - SPLADE_POOLING_FIELDS - SPLADE_POOLING_SPEED_FIELDS)
    if unknown:
        raise FolderError(f"{path}: SpladePooling field {unknown[0]!r} is not implemented here")
    strategy, activation = settings.get("pooling_strategy", "max"), settings.get("activation_function", "relu")
    if not isinstance(strategy, str) or not isinstance(activation, str):
        raise FolderError(f"{path}: pooling_strategy and activation_function must be names")
    dimension = settings.get("embedding_dimension", settings.get("word_embedding_dimension"))
    if dimension is not None and not isinstance(dimension, int):
        raise FolderError(f"{path}: embedding dimension {dimension!r} is not an integer")
    return strategy, activation, dimension


def _pylate_dense(path: Path) -> dict:
    """A PyLate Dense config.json: its fields as written, none unknown (export.heads.colbert checks the values)."""
    if not path.is_file():
        raise FolderError(f"{path}: the Dense module's config.json is missing")
    settings = read_object(path)
    unknown = sorted(set(settings) - PYLATE_DENSE_FIELDS)
    if unknown:
        raise FolderError(f"{path}: Dense field {unknown[0]!r} is not implemented here")
    return settings


def _dense_module(folder: Path) -> tuple[Path, dict]:
    """A sentence-transformers Dense module: its folder and config.json (export.heads.dense checks the fields)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FolderError(f"{path}: the Dense module's config.json is missing")
    return folder, read_object(path)


def check_normalize(folder: Path) -> None:
    """A Normalize module's config.json, where it has one, must keep the sentence embedding in place."""
    path = folder / "config.json"
    if not path.is_file():
        return
    for key, value in read_object(path).items():
        if key not in ("module_input_name", "module_output_name") or value != "sentence_embedding":
            raise FolderError(f"{path}: Normalize field {key!r} = {value!r} is not implemented here")


def _check_transformer_field(path: Path, key: str, value: object, task: str) -> None:
    """One field of the Transformer module's config file: refused unless the exporter does what it says."""
    expected = TASKS[task]
    if key in LOADING_ARGUMENTS:
        if value:
            raise FolderError(f"{path}: {key} {value!r} changes how the model is loaded or called: not supported")
    elif key in MULTI_VECTOR_FIELDS:
        if value is not None:
            raise FolderError(f"{path}: {key} {value!r} (a multi-vector setting) is not supported")
    elif key == "do_lower_case":
        if value:
            raise FolderError(f"{path}: do_lower_case true (lower-casing outside the tokenizer) is not supported")
    elif key == "modality_config":
        wanted = {"text": {"method": "forward", "method_output_name": expected["method_output_name"]}}
        if value != wanted:
            raise FolderError(f"{path}: modality_config {value!r} is not supported (only {wanted!r})")
    elif key in ("transformer_task", "module_output_name"):
        if value != expected[key]:
            raise FolderError(
                f"{path}: {key} {value!r} is not supported for {expected['noun']} (only {expected[key]!r})"
            )
    elif key not in ("max_seq_length", "unpad_inputs"):  # unpad_inputs: speed alone
        raise FolderError(f"{path}: field {key!r} is not implemented here")


def _transformer_config(folder: Path, task: str) -> int | None:
    """The Transformer module's config file, checked; its max_seq_length (None: not declared)."""
    path = next((folder / name for name in TRANSFORMER_CONFIG_FILES if (folder / name).is_file()), None)
    if path is None:
        return None
    declared = read_object(path)
    for key, value in declared.items():
        _check_transformer_field(path, key, value, task)
    return _positive(declared.get("max_seq_length"))


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def read_model_config(folder: Path, task: str) -> dict | None:
    """config_sentence_transformers.json, checked against the task config.json declares."""
    path = folder / "config_sentence_transformers.json"
    if not path.is_file():
        return None
    declared = read_object(path)
    model_type = declared.get("model_type")
    supported = {spec["model_type"]: name for name, spec in TASKS.items()}
    if model_type is not None and model_type not in supported:
        raise FolderError(
            f"{path}: model_type {model_type!r} is not supported (SentenceTransformer for embedders,"
            " CrossEncoder for rerankers and classifiers, SparseEncoder for SPLADE, ColBERT for PyLate's ColBERT)"
        )
    if model_type is not None and "multivector" in (task, supported[model_type]) and supported[model_type] != task:
        raise FolderError(
            f"{path}: model_type {model_type!r} is not supported with modules.json's modules: a ColBERT model is"
            " exported only as a Transformer then PyLate's Dense, and PyLate's Dense only with model_type ColBERT"
        )
    # PyLate writes model_type ColBERT from a transformers folder, and none from a sentence-transformers one.
    known = MODEL_CONFIG_FIELDS | (COLBERT_FIELDS if task == "multivector" else set())
    unknown = sorted(set(declared) - known)
    if unknown:
        raise FolderError(f"{path}: field {unknown[0]!r} is not implemented here")
    if model_type is not None and "sparse" in (task, supported[model_type]) and supported[model_type] != task:
        raise FolderError(
            f"{path}: model_type {model_type!r} is not supported with modules.json's modules: a SparseEncoder"
            " is exported only as an MLMTransformer then SpladePooling, and SpladePooling only in a SparseEncoder"
        )
    if model_type is not None and supported[model_type] != task:
        raise FolderError(
            f"{path}: model_type {model_type!r}, but config.json's architectures make it {TASKS[task]['noun']}"
        )
    if declared.get("truncate_dim") is not None:
        raise FolderError(
            f"{path}: truncate_dim {declared['truncate_dim']!r} is not supported"
            " (the full width is published; declare --matryoshka-dimensions and ask for dimensions per request)"
        )
    prompts = declared.get("prompts") or {}
    default = declared.get("default_prompt_name")
    if task == "classify" and default and isinstance(prompts, dict) and prompts.get(default):
        raise FolderError(f"{path}: default_prompt_name {default!r} on a CrossEncoder is not supported")
    if task == "multivector" and (default or (isinstance(prompts, dict) and any(prompts.values()))):
        raise FolderError(f"{path}: prompts on a ColBERT model are not supported (only its [Q] and [D] prefixes)")
    return declared


def folder_task(folder: Path, classifier: bool) -> str:
    """The folder's task: "sparse" (SpladePooling), "multivector" (PyLate's Dense), "classify" or "embed".

    classifier: whether config.json's architectures make the model a sequence classifier.
    """
    modules_file = folder / "modules.json"
    modules = module_list(modules_file) if modules_file.is_file() else []
    if any(kind in SPLADE_POOLING_TYPES for kind, _ in modules):
        return "sparse"
    if any(kind in PYLATE_DENSE_TYPES for kind, _ in modules):
        return "multivector"
    return "classify" if classifier else "embed"


def read_declarations(folder: Path, task: str) -> Declarations:
    """Check a folder's sentence-transformers files for a task (folder_task's) and read what they declare.

    modules.json first: a chain the exporter does not implement is named by its module types.
    """
    modules_file = folder / "modules.json"
    modules = module_list(modules_file) if modules_file.is_file() else []
    if modules:
        _check_chain(modules_file, modules, task)
    model_config = read_model_config(folder, task)
    max_seq_length = _transformer_config(folder, task)
    tokenizer_config = folder / "tokenizer_config.json"
    if max_seq_length is None and tokenizer_config.is_file():
        max_seq_length = _positive(read_object(tokenizer_config).get("model_max_length"))
    if task == "sparse":
        splade_file = module_folder(folder, modules_file, modules[1][1]) / "config.json"
        if not splade_file.is_file():
            raise FolderError(f"{splade_file}: the SpladePooling module's config.json is missing")
        strategy, activation, dimension = _splade_pooling(splade_file)
        return Declarations(
            pooling_file=splade_file,
            max_seq_length=max_seq_length,
            model_config=model_config,
            splade_pooling=(strategy, activation),
            splade_dimension=dimension,
        )
    if task == "multivector":
        if model_config is None:
            raise FolderError(
                f"{folder / 'config_sentence_transformers.json'}: missing: PyLate's Dense is exported only in a"
                " ColBERT model (model_type ColBERT)"
            )
        dense_folder = module_folder(folder, modules_file, modules[1][1])
        return Declarations(
            max_seq_length=max_seq_length,
            model_config=model_config,
            dense=_pylate_dense(dense_folder / "config.json"),
            dense_folder=dense_folder,
        )
    if task == "classify" or not modules:
        return Declarations(max_seq_length=max_seq_length, model_config=model_config)
    pooling_file = module_folder(folder, modules_file, modules[1][1]) / "config.json"
    if not pooling_file.is_file():
        raise FolderError(f"{pooling_file}: the Pooling module's config.json is missing")
    pooling, dimension = _pooling(pooling_file)
    normalize = CHAIN_KINDS[modules[-1][0]] == "Normalize"
    if normalize:
        check_normalize(module_folder(folder, modules_file, modules[-1][1]))
    dense = tuple(
        _dense_module(module_folder(folder, modules_file, where))
        for kind, where in modules[2:]
        if CHAIN_KINDS[kind] == "Dense"
    )
    return Declarations(pooling, dimension, pooling_file, normalize, max_seq_length, model_config, pooled_dense=dense)
