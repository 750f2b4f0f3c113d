"""The gate's last reference: the library that made a folder, run on that folder, against every published variant.

The other gates compare the ONNX graphs with our PyTorch encoder, which is built from our own
reading of the folder (export.checkpoints.checkpoint): a folder read wrongly would pass them all. Here
sentence-transformers loads the same folder its own way (`SentenceTransformer.encode` for an
embedder, `CrossEncoder.predict` without an activation for a reranker's or classifier's logits,
`SparseEncoder.encode` densified for a SPLADE model) and each published variant, fed as the server
feeds it (the server's tokenizer configuration, the model's default prompt, each text alone and in
padded batches), must give the same answers. A ColBERT model (PyLate's folder) is held to
sentence-transformers' MultiVectorEncoder in export.gate.references.multivector. A SPLADE model's
PyTorch reading is also held to transformers' own masked-LM model on the folder, pooled here by hand
(`check_masked_lm`).

The libraries are imported here only, when an export runs: the server never loads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from export.gate.cases import SENTENCE_BATCH, sentence_pairs
from export.gate.parity import TOLERANCES
from export.gate.references.loop import VariantCheck, VariantSession, unchecked
from export.gate.served import served_feeds
from export.layers.task_adapters import adapter_folders
from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.pipeline.tokenizer import TextTokenizer
from service.pipeline.vocabulary import SPARSE

if TYPE_CHECKING:  # the heads list these checks, and the checkpoint lists the heads
    from sentence_transformers import SentenceTransformer

    from export.checkpoints.checkpoint import Checkpoint

FP32_MIN_COSINE = FIDELITY_MIN_COSINE
"""fp32's least cosine to the library's embeddings: the fidelity rule (served embeddings equal the model's)."""
FP32_MAX_ABS_DIFF = 1e-4
"""fp32's largest difference from the library: embedding values, logits, or a sparse embedding's values relative
to its row's largest value."""
MASKED_LM_MAX_ABS_DIFF = 1e-5
"""A SPLADE model's PyTorch reading against transformers' masked-LM logits pooled by hand: fp32 against fp32."""
LIBRARY_BATCH_SIZE = 4
"""Texts per batch the library is asked to encode (its default is 32). It sorts the texts longest first, and the
gate's long texts reach the model's window: in batches of 32 the first batch pads every one of its rows to that
window. On the Qwen3-0.6B shape's gate texts that is 18,000 padded tokens for 7,900 real ones; in fours, 8,400 (the
library's CPU time halved). A text's answer does not depend on its batch (differences ~2e-7, float rounding)."""
LONG_TEXT_LABEL = "the gate sentences as one text"
"""The last gate input: longer than most models' window, so that truncation is compared too."""


@dataclass(frozen=True)
class LibraryReference:
    """The library's answers on the gate inputs, and those inputs as the server receives them."""

    library: str
    """Name and version: "sentence-transformers 6.2.0"."""
    model_class: str
    """SentenceTransformer, CrossEncoder or SparseEncoder."""
    inputs: list
    """Texts with the model's default prompt before each (as encode puts it), or (query, text) pairs."""
    labels: list[str]
    expected: np.ndarray
    """The library's answer per input: an embedding, a classifier's logits [inputs, labels], or a sparse
    embedding [inputs, vocab_size] (densified)."""
    output: str
    """The graph output compared: embedding, logits or sparse_embedding."""
    normalized: bool
    """Compared after L2-normalising both sides: the folder has no modules.json, so sentence-transformers
    mean-pools without normalising while the exporter normalises; direction and values after scaling compare."""
    compared: str = ""
    """What was compared, where the reference is not sentence-transformers (a model card's code); "": describe's."""
    against: str = ""
    """The reference as failures name it; "": sentence-transformers' model_class on the folder."""
    adapter_ids: list[int] | None = None
    """Each input's task adapter (a model with task adapters: its inputs once with none, then a part again with
    each task's adapter and prompt); None: the model has none."""

    def describe(self) -> str:
        """What was compared, for parity.json."""
        if self.compared:
            return self.compared
        if self.output == "logits":
            return "CrossEncoder.predict logits (no activation) on sentence pairs"
        if self.output == SPARSE:
            return (
                "SparseEncoder.encode sparse embeddings densified, default prompt applied;"
                " max_abs_diff relative to each row's largest value"
            )
        described = "SentenceTransformer.encode embeddings, default prompt applied"
        if self.adapter_ids is not None:
            described += (
                "; then the first inputs with each task's adapter (the transformer under PEFT, set_adapter) and"
                " the task's prompt"
            )
        if self.normalized:
            described += (
                "; compared after L2-normalising both (no modules.json: sentence-transformers"
                " mean-pools without normalising, the exporter normalises)"
            )
        return described


@dataclass(frozen=True)
class LibraryFigures:
    """One published variant against the library: its worst figures, where they were, and what it had to meet."""

    provider: str
    min_cosine: float | None
    """None for logits (which have no meaningful cosine)."""
    worst_cosine_input: str
    max_abs_diff: float
    worst_diff_input: str
    rows: int
    required: dict[str, float]
    failures: list[str]


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """The weight-loading progress bars of transformers off while the library loads the folder (not a stage)."""
    from transformers.utils import logging as transformers_logging  # noqa: PLC0415  (build-time only)

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def library_reference(checkpoint: Checkpoint, sentences: list[str]) -> LibraryReference:
    """sentence-transformers' answers for a checkpoint's folder on the gate sentences (and all of them as one text)."""
    import sentence_transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    folder = str(checkpoint.folder)
    texts = [*sentences, " ".join(sentences)]
    labels = [f"input {i + 1}: {text[:40]!r}" for i, text in enumerate(sentences)] + [LONG_TEXT_LABEL]
    # fp32 whatever the weights are stored in (transformers runs float16 weights in float16): the reference for fp32.
    loading = {"device": "cpu", "local_files_only": True, "model_kwargs": {"dtype": torch.float32}}
    library = f"sentence-transformers {sentence_transformers.__version__}"
    if checkpoint.task == "classify":
        pairs = sentence_pairs(texts)
        with quiet_loading():
            cross_encoder = sentence_transformers.CrossEncoder(folder, **loading)
        logits = cross_encoder.predict(
            pairs, batch_size=LIBRARY_BATCH_SIZE, activation_fn=torch.nn.Identity(), show_progress_bar=False
        )
        expected = np.asarray(logits, dtype=np.float32).reshape(len(pairs), -1)
        return LibraryReference(library, "CrossEncoder", pairs, labels, expected, "logits", normalized=False)
    prefix = checkpoint.serving.prompts.get(checkpoint.serving.default_prompt_name, "")
    served = [prefix + text for text in texts]
    if checkpoint.task == "sparse":
        with quiet_loading():
            sparse_encoder = sentence_transformers.SparseEncoder(folder, **loading)
        encoded = sparse_encoder.encode(
            texts, batch_size=LIBRARY_BATCH_SIZE, convert_to_tensor=True, show_progress_bar=False
        )
        expected = encoded.to_dense().numpy().astype(np.float32)
        return LibraryReference(library, "SparseEncoder", served, labels, expected, SPARSE, normalized=False)
    with quiet_loading():
        model = sentence_transformers.SentenceTransformer(folder, **loading)
    expected = model.encode(texts, batch_size=LIBRARY_BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False)
    normalized = not (checkpoint.folder / "modules.json").is_file()
    tasks = getattr(checkpoint.config, "tasks", ())
    if not tasks:
        return LibraryReference(library, "SentenceTransformer", served, labels, expected, "embedding", normalized)
    import peft  # noqa: PLC0415  (build-time only, for models with task adapters)

    library += f" + peft {peft.__version__}"
    adapter_ids = [0] * len(texts)
    answers = [expected]
    for task_id, (task, task_served, task_expected) in enumerate(_task_answers(checkpoint, model, sentences), 1):
        served += task_served
        labels += [f"{task}: input {i + 1}: {text[:40]!r}" for i, text in enumerate(sentences[:SENTENCE_BATCH])]
        adapter_ids += [task_id] * len(task_served)
        answers.append(task_expected)
    return LibraryReference(
        library,
        "SentenceTransformer",
        served,
        labels,
        np.concatenate(answers),
        "embedding",
        normalized,
        adapter_ids=adapter_ids,
    )


def _task_answers(
    checkpoint: Checkpoint, model: SentenceTransformer, sentences: list[str]
) -> Iterator[tuple[str, list[str], np.ndarray]]:
    """Each task's name, its first SENTENCE_BATCH gate sentences as served, and the library's embeddings of them.

    As served: the task's prompt before each. The library: sentence-transformers with its transformer
    wrapped by PEFT with every task folder's adapter, set_adapter to the task's.
    """
    from peft import PeftModel  # noqa: PLC0415  (build-time only)

    folders = adapter_folders(checkpoint.folder)
    transformer = model[0]
    with quiet_loading():
        wrapped = PeftModel.from_pretrained(transformer.model, str(folders[0]), adapter_name=folders[0].name)
        for folder in folders[1:]:
            wrapped.load_adapter(str(folder), adapter_name=folder.name)
    transformer.model = wrapped.eval()
    texts = sentences[:SENTENCE_BATCH]
    prompts = checkpoint.serving.prompts
    for task, folder in zip(checkpoint.config.tasks, folders, strict=True):
        wrapped.set_adapter(folder.name)
        name = task if task in prompts else checkpoint.serving.default_prompt_name or None
        prefix = prompts.get(name or "", "")
        encoded = model.encode(
            texts, prompt_name=name, batch_size=LIBRARY_BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False
        )
        yield task, [prefix + text for text in texts], encoded


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-30)


def required_figures(variant: str, output: str) -> dict[str, float]:
    """What a variant must meet against the library: fp32 the fidelity rule and 1e-4, the others their gate cosine.

    A classifier's logits: each variant's gate bar on the largest logit difference.
    """
    if output == "logits":
        return {"max_abs_diff": TOLERANCES[variant].max_logits_diff}
    if variant == "fp32":
        return {"min_cosine": FP32_MIN_COSINE, "max_abs_diff": FP32_MAX_ABS_DIFF}
    return {"min_cosine": TOLERANCES[variant].min_cosine}


def measure(
    reference: LibraryReference,
    variant: str,
    session: VariantSession,
    tokenizer: TextTokenizer,
    input_names: list[str],
    *,
    max_length: int,
    pad_token_id: int,
) -> LibraryFigures:
    """A variant's answers on the reference's inputs (each alone and batched: the worse counts) against the library."""
    feeds = served_feeds(
        tokenizer,
        reference.inputs,
        input_names,
        max_length=max_length,
        pad_token_id=pad_token_id,
        adapter_ids=reference.adapter_ids,
    )
    answers = [np.concatenate([session.run([reference.output], feed)[0] for feed in way]) for way in feeds]
    expected = reference.expected
    if reference.normalized:
        expected, answers = _unit(expected), [_unit(answer) for answer in answers]
    differences = np.max([np.abs(answer - expected).max(axis=1) for answer in answers], axis=0)
    if reference.output == SPARSE:  # a SPLADE row's scale is the model's: its values relative to its largest
        differences = differences / np.maximum(np.abs(expected).max(axis=1), 1e-30)
    worst_diff = int(np.argmax(differences))
    required = required_figures(variant, reference.output)
    against = reference.against or f"sentence-transformers' {reference.model_class} on the folder"
    failures = []
    min_cosine, worst_cosine_input = None, ""
    if reference.output != "logits":
        row_cosines = np.min([cosines(answer, expected) for answer in answers], axis=0)
        worst = int(np.argmin(row_cosines))
        min_cosine, worst_cosine_input = float(row_cosines[worst]), reference.labels[worst]
        if min_cosine < required["min_cosine"]:
            failures.append(
                f"{variant}: {reference.output} cosine {min_cosine:.6f} < {required['min_cosine']} to {against}"
                f" at {worst_cosine_input}"
            )
    if "max_abs_diff" in required and differences[worst_diff] > required["max_abs_diff"]:
        failures.append(
            f"{variant}: {reference.output} max |diff| {differences[worst_diff]:.3g} > {required['max_abs_diff']}"
            f" to {against} at {reference.labels[worst_diff]}"
        )
    return LibraryFigures(
        provider=session.get_providers()[0],
        min_cosine=min_cosine,
        worst_cosine_input=worst_cosine_input,
        max_abs_diff=float(differences[worst_diff]),
        worst_diff_input=reference.labels[worst_diff],
        rows=len(reference.inputs),
        required=required,
        failures=failures,
    )


def figures_for_report(reference: LibraryReference, figures: LibraryFigures) -> dict[str, object]:
    """One variant's figures as parity.json records them."""
    report: dict[str, object] = {
        "library": reference.library,
        "class": reference.model_class,
        "compared": reference.describe(),
        "provider": figures.provider,
    }
    if figures.min_cosine is not None:
        report |= {"min_cosine": round(figures.min_cosine, 8), "worst_cosine_input": figures.worst_cosine_input}
    return report | {
        "max_abs_diff": float(f"{figures.max_abs_diff:.3g}"),
        "worst_diff_input": figures.worst_diff_input,
        "rows": figures.rows,
        "required": figures.required,
        "passed": not figures.failures,
    }


def unavailable_reason(checkpoint: Checkpoint, tokenizer: TextTokenizer | None) -> str | None:
    """Why a checkpoint has no library reference (None: it has one)."""
    if checkpoint.folder is None:
        return "random initialisation: there is no folder for a library to load"
    if tokenizer is None:
        return "no tokenizer.json: the server takes token ids only, and the library answers texts"
    return None


def published_check(
    checkpoint: Checkpoint, tokenizer: TextTokenizer | None, input_names: list[str], sentences: list[str]
) -> VariantCheck:
    """The library's answers on the gate inputs, as the check each published variant is held to.

    The library's model is loaded, run and let go here: only its answers are kept.
    """
    reason = unavailable_reason(checkpoint, tokenizer)
    if reason is not None:
        return unchecked(reason, failed=False)
    try:
        reference = library_reference(checkpoint, sentences)
    except Exception as error:  # whatever stops the library from answering: the folder cannot be checked
        failure = f"sentence-transformers could not answer for {checkpoint.folder}: {type(error).__name__}: {error}"
        return unchecked(failure, failed=True)
    return against(reference, checkpoint, tokenizer, input_names)


def against(
    reference: LibraryReference, checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str]
) -> VariantCheck:
    """A variant measured against a library's answers, fed as the server feeds it."""

    def check(variant: str, session: VariantSession) -> tuple[dict[str, object], list[str]]:
        figures = measure(
            reference,
            variant,
            session,
            tokenizer,
            input_names,
            max_length=checkpoint.max_seq_length,
            pad_token_id=checkpoint.config.pad_token_id,
        )
        return figures_for_report(reference, figures), figures.failures

    return check


def check_masked_lm(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    tokenizer: TextTokenizer,
    input_names: list[str],
    sentences: list[str],
) -> tuple[dict[str, object], list[str]]:
    """A SPLADE model's PyTorch reading against transformers' AutoModelForMaskedLM on its folder, pooled by hand.

    The same token batches (the gate sentences through the server's tokenizer) go to both; the
    masked-LM logits are pooled here as SpladePooling pools them, in float64.
    """
    import transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    splade = checkpoint.head
    with quiet_loading():
        masked_lm = transformers.AutoModelForMaskedLM.from_pretrained(
            str(checkpoint.folder), dtype=torch.float32, local_files_only=True
        ).eval()
    worst_diff, worst_input = 0.0, ""
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = tokenizer.encode(chunk).feed(input_names)
        tensors = {name: torch.from_numpy(array) for name, array in feed.items()}
        with torch.inference_mode():
            logits = masked_lm(**tensors).logits.numpy().astype(np.float64)
            ours = model(**tensors).numpy()
        weights = np.log1p(np.maximum(logits * feed["attention_mask"][:, :, None], 0.0))
        if splade.activation_function == "log1p_relu":
            weights = np.log1p(weights)
        expected = weights.max(axis=1) if splade.pooling_strategy == "max" else weights.sum(axis=1)
        differences = np.abs(ours - expected).max(axis=1)
        row = int(np.argmax(differences))
        if differences[row] > worst_diff:
            worst_diff, worst_input = float(differences[row]), f"sentence {start + row + 1}: {chunk[row][:40]!r}"
    passed = worst_diff <= MASKED_LM_MAX_ABS_DIFF
    report = {
        "library": f"transformers {transformers.__version__}",
        "class": type(masked_lm).__name__,
        "compared": "our PyTorch sparse_embedding against the masked-LM logits with SpladePooling applied by hand",
        "max_abs_diff": float(f"{worst_diff:.3g}"),
        "worst_diff_input": worst_input,
        "rows": len(sentences),
        "required": {"max_abs_diff": MASKED_LM_MAX_ABS_DIFF},
        "passed": passed,
    }
    failure = (
        f"PyTorch sparse_embedding max |diff| {worst_diff:.3g} > {MASKED_LM_MAX_ABS_DIFF} to transformers'"
        f" {type(masked_lm).__name__} on the folder at {worst_input}"
    )
    return report, [] if passed else [failure]
