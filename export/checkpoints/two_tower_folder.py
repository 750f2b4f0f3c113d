"""What a two-tower model's folder (CLIP, SigLIP) declares, in the layouts its libraries save, checked.

sentence-transformers saves a two-tower model in one of two layouts, each optionally followed by Normalize:
- up to 5.3 (clip-ViT-B-32): modules.json names a CLIPModel module in its own folder (0_CLIPModel/), which is a
  transformers CLIPModel folder;
- from 5.4 (6 writes it): modules.json names a Transformer module at the folder root, which is the
  transformers folder itself, and its sentence_bert_config.json maps texts to `get_text_features` and images
  to `get_image_features` (module_output_name sentence_embedding); the processor is saved as transformers 5
  saves it, the image processor's settings nested in processor_config.json.
`two_tower_module` reads either (None for any other folder); every field of sentence_bert_config.json and
config_sentence_transformers.json that would change the outputs and is not implemented refuses the export by
name. Texts are padded as sentence-transformers pads them: to the batch's longest, unless the Transformer's
processing_kwargs pads them to max_length.

`image_processor_settings` reads a folder's image processor settings as transformers 5 does: the
`image_processor` object of processor_config.json where there is one, else preprocessor_config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from export.checkpoints.sentence_transformers_folder import (
    LOADING_ARGUMENTS,
    MODULE_KINDS,
    MULTI_VECTOR_FIELDS,
    TRANSFORMER_TYPES,
    FolderError,
    check_normalize,
    module_folder,
    module_list,
    read_model_config,
    read_object,
)
from service.pipeline.images import PREPROCESSOR_CONFIG

CLIP_MODEL_TYPES = (
    "sentence_transformers.models.CLIPModel",  # sentence-transformers 2 to 5.x (clip-ViT-B-32's folder)
    "sentence_transformers.sentence_transformer.modules.clip_model.CLIPModel",  # 6 on
)
"""sentence-transformers' CLIPModel: a transformers CLIPModel folder whose encode is get_image_features of images,
get_text_features of texts."""
TWO_TOWER_MODALITIES = {"text": "get_text_features", "image": "get_image_features"}
"""A two-tower Transformer's modality_config: each modality's method (its output: the features themselves)."""
FEATURES_OUTPUT_NAMES = ("pooler_output", None)
"""A modality's method_output_name that reads the features: pooler_output (transformers 5), or none (4: a tensor)."""
TEXT_PADDINGS = {True: "longest", "longest": "longest", "max_length": "max_length"}
"""processing_kwargs' text padding -> how texts are padded in a batch."""
TRANSFORMER_FIELDS: dict[str, object] = {
    "modality_config": None,
    "transformer_task": "feature-extraction",
    "module_output_name": "sentence_embedding",
    "do_lower_case": None,
    "max_seq_length": None,
    "unpad_inputs": None,  # speed alone
} | dict.fromkeys((*LOADING_ARGUMENTS, *MULTI_VECTOR_FIELDS))
"""A two-tower Transformer's sentence_bert_config.json fields (-> the one value implemented, where one is)."""
PROCESSOR_CONFIG = "processor_config.json"
PROCESSOR_FIELDS = ("processor_class", "image_processor")
"""processor_config.json fields a CLIP or SigLIP processor reads (the tokenizer has its own files)."""


@dataclass(frozen=True)
class TwoTowerModule:
    """A sentence-transformers folder of a two-tower model, checked: where its model is, how it is encoded."""

    folder: Path
    """The transformers model folder (config.json, weights, tokenizer, processor): the module's."""
    library_folder: Path
    """The sentence-transformers folder, whose `encode` is the reference."""
    normalize: bool
    """Whether Normalize follows the model."""
    text_padding: str
    """How sentence-transformers pads texts in a batch: "longest" (its default) or "max_length"."""
    max_seq_length: int | None
    """The module's declared max_seq_length, else its tokenizer's model_max_length (None: neither)."""
    model_config: dict | None
    """config_sentence_transformers.json, checked (None: absent)."""


def two_tower_module(folder: Path) -> TwoTowerModule | None:
    """The folder's two-tower module, checked; None for any other folder (sentence_transformers_folder's to check).

    The module: a CLIPModel module, or a Transformer at the root whose config maps images; optionally then Normalize.
    """
    modules_file = folder / "modules.json"
    modules = module_list(modules_file) if modules_file.is_file() else []
    if not modules:
        return None
    first_type, first_path = modules[0]
    legacy = any(kind in CLIP_MODEL_TYPES for kind, _ in modules)
    transformer_file = folder / "sentence_bert_config.json"
    if not legacy and not (first_type in TRANSFORMER_TYPES and _maps_images(transformer_file)):
        return None
    kinds = ["CLIPModel" if kind in CLIP_MODEL_TYPES else MODULE_KINDS.get(kind, kind) for kind, _ in modules]
    model_kind = kinds[0] if kinds[0] in ("CLIPModel", "Transformer") else "CLIPModel"
    if kinds not in ([model_kind], [model_kind, "Normalize"]):
        raise FolderError(
            f"{modules_file}: modules {' -> '.join(kinds)}: a {model_kind} is implemented alone or followed by"
            " Normalize"
        )
    if len(modules) == 2:
        check_normalize(module_folder(folder, modules_file, modules[1][1]))
    model_folder = module_folder(folder, modules_file, first_path)
    if not legacy and model_folder != folder.resolve():
        raise FolderError(f"{modules_file}: the Transformer module is at path {first_path!r}, not the folder root")
    padding, max_seq_length = _transformer_settings(model_folder / transformer_file.name)
    model_config = read_model_config(folder, "embed")
    prompts = (model_config or {}).get("prompts") or {}
    if isinstance(prompts, dict) and any(prompts.values()):
        raise FolderError(
            f"{folder / 'config_sentence_transformers.json'}: prompts on a two-tower model are not implemented"
        )
    return TwoTowerModule(
        folder=model_folder,
        library_folder=folder,
        normalize=len(modules) == 2,
        text_padding=padding,
        max_seq_length=max_seq_length or _model_max_length(model_folder),
        model_config=model_config,
    )


def _maps_images(path: Path) -> bool:
    """Whether a Transformer module's config maps images (a two-tower model's root Transformer)."""
    if not path.is_file():
        return False
    modalities = read_object(path).get("modality_config")
    return isinstance(modalities, dict) and "image" in modalities


def _transformer_settings(path: Path) -> tuple[str, int | None]:
    """A two-tower module's sentence_bert_config.json, checked: its text padding and declared max_seq_length.

    A legacy CLIPModel module may have none (then texts pad to the longest, the tokenizer says the length).
    """
    if not path.is_file():
        return "longest", None
    padding = "longest"
    declared = read_object(path)
    for key, value in declared.items():
        if key not in TRANSFORMER_FIELDS:
            raise FolderError(f"{path}: field {key!r} is not implemented here")
        if key == "modality_config":
            _check_modalities(path, value)
        elif key in ("transformer_task", "module_output_name") and value != TRANSFORMER_FIELDS[key]:
            raise FolderError(f"{path}: {key} {value!r} is not supported (only {TRANSFORMER_FIELDS[key]!r})")
        elif key == "processing_kwargs":
            padding = _text_padding(path, value)
        elif key in LOADING_ARGUMENTS and value:
            raise FolderError(f"{path}: {key} {value!r} changes how the model is loaded or called: not supported")
        elif key in MULTI_VECTOR_FIELDS and value is not None:
            raise FolderError(f"{path}: {key} {value!r} (a multi-vector setting) is not supported")
        elif key == "do_lower_case" and value:
            raise FolderError(f"{path}: do_lower_case true (lower-casing outside the tokenizer) is not supported")
    max_seq_length = declared.get("max_seq_length")
    return padding, max_seq_length if isinstance(max_seq_length, int) and max_seq_length > 0 else None


def _check_modalities(path: Path, value: object) -> None:
    """modality_config must map exactly texts to get_text_features and images to get_image_features."""
    wanted = {
        modality: {"method": method, "method_output_name": "pooler_output"}
        for modality, method in TWO_TOWER_MODALITIES.items()
    }
    if not isinstance(value, dict) or set(value) != set(TWO_TOWER_MODALITIES):
        raise FolderError(f"{path}: modality_config {value!r} is not supported (only {wanted!r})")
    for modality, method in TWO_TOWER_MODALITIES.items():
        entry = value[modality]
        if (
            not isinstance(entry, dict)
            or set(entry) != {"method", "method_output_name"}
            or entry["method"] != method
            or entry["method_output_name"] not in FEATURES_OUTPUT_NAMES
        ):
            raise FolderError(f"{path}: modality_config {modality!r} {entry!r} is not supported (only {wanted!r})")


def _text_padding(path: Path, value: object) -> str:
    """processing_kwargs: only a text padding (longest or max_length) is implemented; how texts are padded."""
    if not value:
        return "longest"
    text = value.get("text") if isinstance(value, dict) else None
    if set(value) != {"text"} or not isinstance(text, dict) or set(text) != {"padding"}:
        raise FolderError(
            f"{path}: processing_kwargs {value!r} is not supported (only a text padding: {{'text': {{'padding':"
            " 'max_length'}}})"
        )
    padding = text["padding"]
    if not isinstance(padding, (bool, str)) or padding not in TEXT_PADDINGS:
        raise FolderError(f"{path}: processing_kwargs text padding {padding!r} is not supported")
    return TEXT_PADDINGS[padding]


def _model_max_length(folder: Path) -> int | None:
    """tokenizer_config.json's model_max_length (None: absent)."""
    path = folder / "tokenizer_config.json"
    value = read_object(path).get("model_max_length") if path.is_file() else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def image_processor_settings(folder: Path) -> tuple[Path, dict]:
    """The folder's image processor settings as transformers 5 reads them, and the file they are in.

    processor_config.json's `image_processor` object where it has one (any other field than PROCESSOR_FIELDS is
    refused), else preprocessor_config.json. A FolderError names the file where neither holds them.
    """
    processor_file = folder / PROCESSOR_CONFIG
    if processor_file.is_file():
        declared = read_object(processor_file)
        if "image_processor" in declared:
            unknown = sorted(set(declared) - set(PROCESSOR_FIELDS))
            if unknown:
                raise FolderError(f"{processor_file}: field {unknown[0]!r} is not implemented here")
            settings = declared["image_processor"]
            if not isinstance(settings, dict):
                raise FolderError(f"{processor_file}: image_processor is not a JSON object")
            return processor_file, settings
    preprocessor_file = folder / PREPROCESSOR_CONFIG
    if not preprocessor_file.is_file():
        raise FolderError(
            f"{preprocessor_file}: No such file or directory (nor an image_processor in {PROCESSOR_CONFIG})"
        )
    return preprocessor_file, read_object(preprocessor_file)
