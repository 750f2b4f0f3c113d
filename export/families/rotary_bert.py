"""The rotary BERT family (GTE, NomicBERT, jina-embeddings-v3): its config.json and weight names.

They are read onto one encoder, export.families.rotary_bert_encoder. Each config.json is read as the
installed transformers reads it (its native `gte` and `nomic_bert` configurations, with their defaults
for what a file leaves out), since transformers is the reference the export is checked against. Keys of
the families' remote-code configurations that transformers ignores are still checked: one that asks for
something else than what is built (NomicBERT's `rotary_emb_interleaved`, `prenorm`, biases or
`rotary_scaling_factor`; GTE's `logn_attention_scale` or RMSNorm) or that disagrees with the native
reading (`n_embd` against `hidden_size`) is refused by name. Weights may be named as the original
checkpoints name them (GTE's `encoder.layer.N.attention.qkv_proj`, NomicBERT's
`encoder.layers.N.attn.Wqkv`; what `save_pretrained` writes) or as transformers' modules do
(`layers.N.self_attn.q_proj`): Q, K and V, and W_up and W_gate, are joined into this encoder's single
matrices. jina-embeddings-v3 is read in its transformers-native form (model_type jina_embeddings_v3, as
jinaai/jina-embeddings-v3-hf ships it), its task adapters by export.layers.task_adapters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import BERT_EMBEDDINGS, ModuleRenames, Slot, as_slot
from export.families.encoder_config import read_activation, read_shared_fields
from export.families.family import BERT_FUSIONS, Family, Format
from export.families.rotary_bert_encoder import RotaryBertConfig, RotaryBertEncoder
from export.layers.task_adapters import Target, adapter_folders, read_task_adapters

ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
ROPE_TYPES = ("default", "linear")
ROPE_KEYS = ("rope_type", "type", "rope_theta", "factor", "partial_rotary_factor")
NOMIC_GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
"""NomicBERT's remote-code activation_function -> the native hidden_act it agrees with."""
NOMIC_SIZES = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "layer_norm_eps",
}
"""NomicBERT's remote-code size keys -> the native keys transformers reads instead."""
NOMIC_FIXED = {
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None,
    "rotary_emb_scale_base": None,
    "prenorm": False,
    "parallel_block": False,
    "causal": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "use_rms_norm": False,
    "moe_every_n_layers": 0,
}
"""NomicBERT's remote-code settings, each at the one value that this encoder (and transformers') implements."""
GTE_FIXED = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm", "logn_attention_scale": False}
"""GTE's remote-code settings, each at the one value that this encoder (and transformers') implements."""
BUFFERS = ("position_ids", "token_type_ids", "inv_freq", "original_inv_freq")
"""Saved buffers that are not weights (positions and rotary frequencies are computed)."""
HEAD_PREFIXES = ("pooler.", "classifier.", "lm_head.", "cls.")
WRAPPERS = ("0.auto_model.", "model.")


BERT_DEFAULTS = {
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
}
"""transformers' defaults of the BERT-style keys the three families' native configurations share."""
GTE_DEFAULTS = BERT_DEFAULTS | {
    "vocab_size": 250048,
    "hidden_act": "gelu",
    "max_position_embeddings": 8192,
    "type_vocab_size": 1,
    "pad_token_id": 1,
    "rope_theta": 160_000.0,
}
"""transformers' GteConfig defaults: a key config.json leaves out takes its value here."""
JINA_DEFAULTS = GTE_DEFAULTS | {
    "vocab_size": 250002,
    "max_position_embeddings": 8194,
    "rope_theta": 20_000.0,
    "layer_norm_eps": 1e-5,
}
"""transformers' JinaEmbeddingsV3Config defaults (the rest as GTE's)."""
NOMIC_BERT_DEFAULTS = BERT_DEFAULTS | {
    "vocab_size": 30528,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "type_vocab_size": 2,
    "pad_token_id": 0,
    "rope_theta": 1000.0,
}
"""transformers' NomicBertConfig defaults."""


def _shown(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _check_fixed(hf_config: dict, fixed: dict[str, object]) -> None:
    for key, implemented in fixed.items():
        if key in hf_config and hf_config[key] != implemented:
            raise ArchitectureError(f"unsupported {key} {_shown(hf_config[key])} (only {_shown(implemented)})")


def _rope(hf_config: dict) -> tuple[float, float]:
    """(θ, linear factor) of rope_scaling / rope_parameters / rope_theta, read as transformers reads them."""
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    for key, value in rope.items():
        if key not in ROPE_KEYS:
            raise ArchitectureError(f"unsupported rope parameter {key!r} (supported: {', '.join(ROPE_KEYS)})")
        if isinstance(value, dict):
            raise ArchitectureError(f"unsupported per-layer rope parameters {key!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ArchitectureError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ArchitectureError(f"unsupported partial_rotary_factor {partial!r}: only rotary over whole heads")
    theta = rope.get("rope_theta", hf_config["rope_theta"])
    return float(theta), float(rope["factor"]) if kind == "linear" else 1.0


def _common(hf_config: dict, defaults: dict[str, object], pooling: str, normalize: bool) -> dict[str, object]:
    """The fields the three families read alike: config.json's keys over the family's defaults (as transformers)."""
    read = defaults | hf_config
    shared = read_shared_fields(read, pooling, normalize)
    theta, factor = _rope(read)
    return shared | {
        "head_dim": read.get("head_dim") or shared["d_model"] // shared["num_heads"],
        "rope_theta": theta,
        "rope_linear_factor": factor,
        "type_vocab_size": read["type_vocab_size"],
        "activation": read_activation(read, "hidden_act", ACTIVATIONS, defaults["hidden_act"]),
        "layer_norm_eps": read["layer_norm_eps"],
        "max_positions": read["max_position_embeddings"],
    }


def gte_config(hf_config: dict, pooling: str, normalize: bool) -> RotaryBertConfig:
    """Translate a transformers-native GTE config.json (model_type gte)."""
    _check_fixed(hf_config, GTE_FIXED)
    return RotaryBertConfig(
        **_common(hf_config, GTE_DEFAULTS, pooling, normalize),
        attention_bias=True,
        up_gate_bias=False,
        down_bias=True,
    )


def nomic_bert_config(hf_config: dict, pooling: str, normalize: bool) -> RotaryBertConfig:
    """Translate a NomicBERT config.json (model_type nomic_bert), native or in its remote-code form."""
    _check_fixed(hf_config, NOMIC_FIXED)
    common = _common(hf_config, NOMIC_BERT_DEFAULTS, pooling, normalize)
    native = {
        "hidden_size": common["d_model"],
        "num_attention_heads": common["num_heads"],
        "num_hidden_layers": common["num_layers"],
        "intermediate_size": common["ffn_dim"],
        "layer_norm_eps": common["layer_norm_eps"],
    }
    for legacy, key in NOMIC_SIZES.items():
        if legacy in hf_config and hf_config[legacy] != native[key]:
            raise ArchitectureError(
                f"{legacy} {hf_config[legacy]!r} disagrees with {key} {native[key]!r}, which transformers reads"
            )
    if "rotary_emb_base" in hf_config and float(hf_config["rotary_emb_base"]) != common["rope_theta"]:
        raise ArchitectureError(
            f"rotary_emb_base {hf_config['rotary_emb_base']!r} disagrees with rope_theta {common['rope_theta']!r},"
            " which transformers reads"
        )
    gated, activation = (
        hf_config.get("activation_function"),
        hf_config.get("hidden_act", NOMIC_BERT_DEFAULTS["hidden_act"]),
    )
    if gated is not None and NOMIC_GATED_ACTIVATIONS.get(gated) != activation:
        raise ArchitectureError(
            f"unsupported activation_function {gated!r} with hidden_act {activation!r}"
            f" (supported: {', '.join(f'{k} with {v}' for k, v in NOMIC_GATED_ACTIVATIONS.items())})"
        )
    # The remote-code form names its length n_positions; rotary angles do not depend on it.
    max_positions = hf_config.get("max_position_embeddings") or hf_config.get("n_positions")
    return RotaryBertConfig(
        **(common | {"max_positions": max_positions or NOMIC_BERT_DEFAULTS["max_position_embeddings"]}),
        attention_bias=False,
        up_gate_bias=False,
        down_bias=False,
    )


def jina_config(hf_config: dict, pooling: str, normalize: bool) -> RotaryBertConfig:
    """Translate a transformers-native jina-embeddings-v3 config.json (model_type jina_embeddings_v3).

    Its task adapters are not in config.json: export.layers.task_adapters reads them from their folders.
    """
    return RotaryBertConfig(
        **_common(hf_config, JINA_DEFAULTS, pooling, normalize),
        attention_bias=True,
        up_gate_bias=True,
        down_bias=True,
        gated=False,
    )


_EMBEDDINGS = {**BERT_EMBEDDINGS, "emb_ln": "embeddings.norm"}
_NATIVE_LAYER: dict[str, str | Slot] = {
    "self_attn.q_proj": Slot("attention.qkv", 0, 3),
    "self_attn.k_proj": Slot("attention.qkv", 1, 3),
    "self_attn.v_proj": Slot("attention.qkv", 2, 3),
    "self_attn.o_proj": "attention.output",
    "post_attention_layernorm": "attention_norm",
    "mlp.up_proj": Slot("feed_forward.up_gate", 0, 2),
    "mlp.gate_proj": Slot("feed_forward.up_gate", 1, 2),
    "mlp.down_proj": "feed_forward.down",
    "post_mlp_layernorm": "output_norm",
}
"""The layer modules as transformers' modules name them (Q, K and V, W_up and W_gate, apart)."""
_ORIGINAL_NORMS = {"norm1": "attention_norm", "norm2": "output_norm"}
"""NomicBERT's and Jina's original names of a layer's two LayerNorms."""
_JINA_LAYER: dict[str, str | Slot] = {
    **{module: slot for module, slot in _NATIVE_LAYER.items() if not module.startswith("mlp.")},
    **_ORIGINAL_NORMS,
    "mlp.fc1": "feed_forward.up",
    "mlp.fc2": "feed_forward.down",
    "mixer.Wqkv": "attention.qkv",
    "mixer.out_proj": "attention.output",
}
"""jina-embeddings-v3's layer modules, as transformers' modules name them and as its checkpoints do (what
save_pretrained writes: the original model's names, Q, K and V in one Wqkv)."""
_GTE_LAYER: dict[str, str | Slot] = {
    **_NATIVE_LAYER,
    "attention.qkv_proj": "attention.qkv",
    "attention.o_proj": "attention.output",
    "attn_ln": "attention_norm",
    "mlp.up_gate_proj": "feed_forward.up_gate",
    "mlp_ln": "output_norm",
}
_NOMIC_LAYER: dict[str, str | Slot] = {
    **_NATIVE_LAYER,
    **_ORIGINAL_NORMS,
    "attn.Wqkv": "attention.qkv",
    "attn.out_proj": "attention.output",
    "mlp.fc11": Slot("feed_forward.up_gate", 0, 2),
    "mlp.fc12": Slot("feed_forward.up_gate", 1, 2),
    "mlp.fc2": "feed_forward.down",
}
_LAYERS = r"encoder\.layers?|layers"
"""The layer list: encoder.layer (GTE's original), encoder.layers (NomicBERT's, Jina's), layers (transformers')."""


def _names(prefixes: tuple[str, ...], layer_modules: dict[str, str | Slot]) -> ModuleRenames:
    return ModuleRenames((*prefixes, *WRAPPERS), HEAD_PREFIXES, _LAYERS, layer_modules, _EMBEDDINGS, BUFFERS)


rename_gte_weights = _names(("new.", "gte."), _GTE_LAYER).split
"""GTE's parameter names (original or transformers') -> the encoder's, and the task heads' weights apart."""
rename_nomic_bert_weights = _names(("nomic_bert.",), _NOMIC_LAYER).split
"""NomicBERT's parameter names (original or transformers') -> the encoder's, and the task heads' weights apart."""
rename_jina_weights = _names(("roberta.",), _JINA_LAYER).split
"""jina-embeddings-v3's parameter names (transformers') -> the encoder's, and the task heads' weights apart."""


def jina_adapter_targets(num_layers: int) -> dict[str, Target]:
    """Where a LoRA of each of jina-embeddings-v3's modules (transformers' names) lands in the encoder."""
    targets = {"embeddings.word_embeddings": Target("embeddings.token")}
    for index in range(num_layers):
        for module, place in _JINA_LAYER.items():
            slot, part, parts = as_slot(place)
            if "norm" not in module:
                for layer in (f"layers.{index}", f"encoder.layers.{index}"):
                    targets[f"{layer}.{module}"] = Target(f"layers.{index}.{slot}", part, parts)
    return targets


def read_jina_adapters(folder: Path, config: RotaryBertConfig) -> tuple[RotaryBertConfig, dict[str, torch.Tensor]]:
    """jina-embeddings-v3's task adapters (its PEFT folders) on its configuration, and their weights (none: none)."""
    if not adapter_folders(folder):
        return config, {}
    width = config.num_heads * config.head_dim
    shapes = {"embeddings.token": (config.vocab_size, config.d_model)}
    for index in range(config.num_layers):
        shapes[f"layers.{index}.attention.qkv"] = (config.d_model, 3 * width)
        shapes[f"layers.{index}.attention.output"] = (width, config.d_model)
        shapes[f"layers.{index}.feed_forward.up"] = (config.d_model, config.ffn_dim)
        shapes[f"layers.{index}.feed_forward.down"] = (config.ffn_dim, config.d_model)
    adapters = read_task_adapters(folder, jina_adapter_targets(config.num_layers), shapes)
    config = dataclasses.replace(config, tasks=adapters.tasks, lora_columns=adapters.columns)
    weights = {}
    for module, state in adapters.weights.items():
        owner, _, attribute = module.rpartition(".")
        for key, tensor in state.items():
            weights[f"{owner}.{attribute}_lora.{key}"] = tensor
    return config, weights


FAMILY = Family(
    name="rotary_bert",
    config_type=RotaryBertConfig,
    build=RotaryBertEncoder,
    formats=(
        Format("gte", gte_config, rename_gte_weights),
        Format("nomic_bert", nomic_bert_config, rename_nomic_bert_weights),
        Format("jina_embeddings_v3", jina_config, rename_jina_weights, read_adapters=read_jina_adapters),
    ),
    graph_forms=BERT_FUSIONS,
)
"""BERT with rotary positions: GTE, NomicBERT and jina-embeddings-v3."""
