"""The one list of model families, and the questions the exporter asks it.

A family is one module of export.families ending in its declaration (export.families.family.Family);
adding one is that module and one line in FAMILIES.
"""

from __future__ import annotations

from export.checkpoints.architecture_error import ArchitectureError
from export.families import bert, clip, deberta, eurobert, gemma, modernbert, qwen3, rotary_bert, siglip
from export.families.family import EncoderSettings, Family, Format

FAMILIES: tuple[Family, ...] = (
    bert.FAMILY,
    modernbert.FAMILY,
    deberta.FAMILY,
    rotary_bert.FAMILY,
    qwen3.FAMILY,
    gemma.FAMILY,
    eurobert.FAMILY,
    clip.FAMILY,
    siglip.FAMILY,
)
"""Every family the exporter reads."""
FORMATS: dict[str, Format] = {form.model_type: form for family in FAMILIES for form in family.formats}
"""Supported model_type -> how to read it."""
_BY_CONFIG: dict[type, Family] = {family.config_type: family for family in FAMILIES}
REFUSAL_REASONS = {
    "new": "GTE's remote-code form, which transformers runs only with trust_remote_code;"
    " its transformers-native form (model_type 'gte', as alibaba-nlp-community/gte-base-en-v1.5) is supported",
    "gemma3": "Gemma3's image-and-text model; its text model (model_type 'gemma3_text', as EmbeddingGemma)"
    " is supported",
    "siglip2": "SigLIP 2's NaFlex model (patches at each image's own aspect ratio) is not implemented; SigLIP 2's"
    " fixed-resolution checkpoints (model_type 'siglip', as google/siglip2-base-patch16-224) are",
    "embedding_gemma2": "EmbeddingGemma 2, a Gemma4-based model (per-layer embeddings, images and audio), is not"
    " implemented; EmbeddingGemma (model_type 'gemma3_text') is",
    "embedding_gemma2_text": "EmbeddingGemma 2's text model (Gemma4's per-layer embeddings) is not implemented;"
    " EmbeddingGemma (model_type 'gemma3_text') is",
}
"""Unsupported model_types worth a reason beyond the list of supported ones."""


def model_format(model_type: object) -> Format:
    """How to read a config.json's model_type, or one line naming every supported one."""
    if model_type not in FORMATS:
        reason = f": {REFUSAL_REASONS[model_type]}" if model_type in REFUSAL_REASONS else ""
        supported = ", ".join(FORMATS)
        raise ArchitectureError(f"unsupported architecture {model_type!r}{reason} (supported: {supported})")
    return FORMATS[model_type]


def family_of(config: EncoderSettings) -> Family:
    """The family a configuration belongs to."""
    return _BY_CONFIG[type(config)]


def classifier_style(model_type: str) -> str | None:
    """The classifier head layout of a model type's sequence-classification models (None: none implemented)."""
    form = FORMATS.get(model_type)
    return None if form is None else form.classifier_style


def classifier_model_types() -> tuple[str, ...]:
    """The model types with a sequence-classification head implemented."""
    return tuple(model_type for model_type, form in FORMATS.items() if form.classifier_style is not None)


def adapter_model_types() -> tuple[str, ...]:
    """The model types whose task adapters are read."""
    return tuple(model_type for model_type, form in FORMATS.items() if form.read_adapters is not None)
