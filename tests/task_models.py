"""Tiny real task repositories built without torch: classifiers and an embedder with prompts and Matryoshka widths.

The classifiers' graph is a fixed linear function of the attended tokens, so the answer shows which
tokens and which segment ids went in: score = mean over attended tokens of id * (1 + segment) / 100,
logits = score * weights + biases. Their tokenizers are real ones, trained here with `tokenizers`
on a few sentences: a BERT-form WordPiece (`[CLS] a [SEP] b [SEP]`, segment ids 0/1) and a
RoBERTa-form one (`<s> a </s></s> b </s>`, no token_type_ids input). The embedder is the default
repository's model with prompts, a default prompt and Matryoshka widths in its config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from protocol import model_config_pb2 as mc
from service.core.repository import (
    P_DEFAULT_PROMPT_NAME,
    P_EMBEDDING_RANGES,
    P_LABELS,
    P_MATRYOSHKA_DIMENSIONS,
    P_MODEL_TYPE,
    P_PROMPTS,
    P_SIMILARITY_FN_NAME,
    P_TASK,
    config_text,
    parse_config,
)
from tests.onnx_graphs import constant

SENTENCES = (
    "How do I bake bread at home?",
    "Knead the dough and let it rise for an hour.",
    "Bread needs flour, water, salt and yeast.",
    "Stocks fell sharply today after the report.",
    "The weather is sunny with a light breeze.",
    "A zebra has black and white stripes.",
)
"""The tokenizers' training text, and good test text."""
MAX_SEQUENCE_LENGTH = 24
"""Every task model's max_sequence_length: short, so truncation is easy to reach."""
BERT_CLASSIFIER = "bert-classifier"
"""Three labels, BERT-form tokenizer, takes token_type_ids."""
ROBERTA_RERANKER = "roberta-reranker"
"""One label, RoBERTa-form tokenizer, no token_type_ids input."""
EMBEDDER = "prompted-embedder"
"""The default model with prompts (default `passage`) and Matryoshka widths."""
LABELS = {BERT_CLASSIFIER: ("negative", "neutral", "positive"), ROBERTA_RERANKER: ("LABEL_0",)}
WEIGHTS = {BERT_CLASSIFIER: ([1.0, -1.0, 0.5], [0.0, 1.0, 0.0]), ROBERTA_RERANKER: ([1.0], [-2.0])}
PROMPTS = {"query": "query: ", "passage": "passage: "}
MATRYOSHKA_DIMENSIONS = (128, 64)


def wordpiece_tokenizer(style: str) -> Tokenizer:
    """A WordPiece tokenizer trained on SENTENCES, pairing as BERT (`bert`) or RoBERTa (`roberta`) does."""
    if style == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        start, end, pad, unknown = "[CLS]", "[SEP]", "[PAD]", "[UNK]"
    else:
        specials = ["<pad>", "<unk>", "<s>", "</s>"]
        start, end, pad, unknown = "<s>", "</s>", "<pad>", "<unk>"
    tokenizer = Tokenizer(models.WordPiece(unk_token=unknown))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    ids = {token: tokenizer.token_to_id(token) for token in (start, end)}
    # BERT marks the second member with segment 1; RoBERTa separates the members with two </s> and has no segments.
    second = f"$B:1 {end}:1" if style == "bert" else f"{end}:0 $B:0 {end}:0"
    pair = f"{start} $A:0 {end}:0 {second}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start} $A:0 {end}:0", pair=pair, special_tokens=list(ids.items())
    )
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id(pad), pad_token=pad)
    return tokenizer


def classifier_graph(
    path: Path, weights: list[float], biases: list[float], segments: bool, *, scale: float = 100, offset: float = 0
) -> None:
    """The classifier graph (see the module docstring), its score s / scale - offset.

    `segments`: whether it takes token_type_ids.
    """
    names = ("input_ids", "attention_mask", "token_type_ids") if segments else ("input_ids", "attention_mask")
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"]) for name in names]
    segment_nodes = [
        helper.make_node("Cast", ["token_type_ids"], ["segments"], to=TensorProto.FLOAT),
        constant("one", [1], TensorProto.FLOAT),
        helper.make_node("Add", ["segments", "one"], ["segment_weight"]),
        helper.make_node("Mul", ["segment_weight", "mask"], ["weight"]),
    ]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        *(segment_nodes if segments else [helper.make_node("Identity", ["mask"], ["weight"])]),
        helper.make_node("Mul", ["ids", "weight"], ["weighted"]),
        constant("sequence_axis", [1]),
        helper.make_node("ReduceSum", ["weighted", "sequence_axis"], ["total"], keepdims=1),
        helper.make_node("ReduceSum", ["mask", "sequence_axis"], ["count"], keepdims=1),
        helper.make_node("Div", ["total", "count"], ["mean"]),
        constant("scale", [scale], TensorProto.FLOAT),
        helper.make_node("Div", ["mean", "scale"], ["scaled"]),
        constant("offset", [offset], TensorProto.FLOAT),
        helper.make_node("Sub", ["scaled", "offset"], ["score"]),
        helper.make_node(
            "Constant", [], ["weights"], value=helper.make_tensor("w", TensorProto.FLOAT, [1, len(weights)], weights)
        ),
        helper.make_node(
            "Constant", [], ["biases"], value=helper.make_tensor("b", TensorProto.FLOAT, [len(biases)], biases)
        ),
        helper.make_node("MatMul", ["score", "weights"], ["product"]),
        helper.make_node("Add", ["product", "biases"], ["logits"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", len(weights)])]
    graph = helper.make_graph(nodes, "classifier", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


def write_classifier(
    folder: Path, style: str, labels: tuple[str, ...], weights: tuple[list[float], list[float]]
) -> None:
    """A classify model folder: graph, trained tokenizer.json and config.pbtxt (task, labels, logits)."""
    segments = style == "bert"
    (folder / "1").mkdir(parents=True)
    classifier_graph(folder / "1" / "model.onnx", *weights, segments=segments)
    tokenizer = wordpiece_tokenizer(style)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = mc.ModelConfig(name=folder.name, platform="onnxruntime_onnx", max_batch_size=16)
    for name in ("input_ids", "attention_mask", "token_type_ids")[: 3 if segments else 2]:
        config.input.add(name=name, data_type=mc.TYPE_INT64, dims=[-1])
    config.output.add(name="logits", data_type=mc.TYPE_FP32, dims=[len(labels)])
    parameters = {
        P_TASK: "classify",
        P_LABELS: json.dumps(list(labels)),
        P_MODEL_TYPE: "bert" if segments else "roberta",
        "max_sequence_length": str(MAX_SEQUENCE_LENGTH),
        "vocab_size": str(tokenizer.get_vocab_size()),
        "pad_token_id": str(tokenizer.padding["pad_id"]),
        "tokenizer": "tokenizer.json",
    }
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    (folder / "config.pbtxt").write_text(config_text(config))


def write_embedder(source: Path, folder: Path) -> None:
    """The default model (linked) with prompts, a default prompt, similarity and Matryoshka widths."""
    source = source.resolve()
    config = parse_config((source / "config.pbtxt").read_text(), source)
    (folder / "1").mkdir(parents=True)
    (folder / "tokenizer.json").symlink_to(source / "tokenizer.json")
    (folder / "1" / "model.onnx").symlink_to(source / "1" / "model.onnx")
    # The source's ranges do not cover the widths declared here: this embedder serves no int8/uint8.
    for key in [key for key in config.parameters if key.startswith(("variant.", "preferred_variant."))]:
        del config.parameters[key]
    del config.parameters[P_EMBEDDING_RANGES]
    config.name, config.default_model_filename = folder.name, "model.onnx"
    config.parameters[P_PROMPTS].string_value = json.dumps(PROMPTS)
    config.parameters[P_DEFAULT_PROMPT_NAME].string_value = "passage"
    config.parameters[P_SIMILARITY_FN_NAME].string_value = "cosine"
    config.parameters[P_MATRYOSHKA_DIMENSIONS].string_value = json.dumps(list(MATRYOSHKA_DIMENSIONS))
    config.parameters[P_MODEL_TYPE].string_value = "bert"
    (folder / "config.pbtxt").write_text(config_text(config))


def task_repository(root: Path, default_model: Path | None = None) -> Path:
    """A repository holding both classifiers and (given the default model's folder) the prompted embedder."""
    root.mkdir(parents=True, exist_ok=True)
    write_classifier(root / BERT_CLASSIFIER, "bert", LABELS[BERT_CLASSIFIER], WEIGHTS[BERT_CLASSIFIER])
    write_classifier(root / ROBERTA_RERANKER, "roberta", LABELS[ROBERTA_RERANKER], WEIGHTS[ROBERTA_RERANKER])
    if default_model is not None:
        write_embedder(default_model, root / EMBEDDER)
    return root


def expected_logits(folder: Path, pairs: list[tuple[str, ...]]) -> np.ndarray:
    """The folder's graph run in onnxruntime on its tokenizer's own encoding (pairs or single texts)."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=MAX_SEQUENCE_LENGTH)
    encodings = tokenizer.encode_batch([pair if len(pair) == 2 else pair[0] for pair in pairs])
    session = onnxruntime.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    wanted = {i.name for i in session.get_inputs()}
    return session.run(["logits"], {name: value for name, value in feeds.items() if name in wanted})[0]


def copy_repository(source: Path, target: Path) -> Path:
    """A copy of a task repository (symlinks kept), for tests that edit a config."""
    shutil.copytree(source, target, symlinks=True)
    return target
