"""The served tokenizer is the one the reference library runs: transformers' tokenizer of the folder, as it loads.

transformers 5 builds some tokenizer classes from their own definition around the folder's
vocabulary rather than taking the folder's tokenizer.json whole: its XLMRobertaTokenizer leaves
out a normaliser the file declares (NFKC), so `…` is one token there and three `.` through the
file. sentence-transformers, PyLate and FlagEmbedding all tokenise through transformers, so the
repository ships that tokenizer (its `backend_tokenizer`, a `tokenizers` pipeline), and when it
differs from the folder's file the export says so in one line: the first input that tokenises
differently and both token sequences. A folder that ships no tokenizer.json (CLIP's vocab.json and
merges.txt, an older BERT's vocab.txt) is served the pipeline transformers builds from its vocabulary
(`with_converted_tokenizer`, for text and two-tower models alike), or refused where transformers tokenises it in
Python alone (SigLIP's spiece.model).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from export.checkpoints.checkpoint import Checkpoint
from export.gate.cases import read_sentences
from export.sources import UnusableSource

CONVERTED_TOKENIZER_FOLDER = "converted-tokenizer"
"""The scratch folder the library's tokenizer.json is written in for a folder that ships none."""
VOCABULARY_FILES = (
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
"""Files of a tokenizer transformers reads without tokenizer.json (CLIP's vocab.json + merges.txt, SigLIP's
spiece.model): a folder holding any has a tokenizer to serve."""
LIBRARY_TOKENIZER_FOLDER = "library-tokenizer"
"""The scratch folder the library's tokenizer files are written in when they replace the folder's."""
PROBE_TEXTS = (
    "We'll see… maybe next year.",
    "Full-width letters: \uff26\uff55\uff4c\uff4c \uff37\uff49\uff44\uff54\uff48 \uff11\uff12\uff13",
    "ﬁne ﬂour, eﬀort and ﬃx",
    "ｶﾀｶﾅ and ① ㎏ ™ ½",
    "double  spaces\tand\ttabs",
)
"""Inputs that tell normalisers and pre-tokenisers apart, tried after the gate sentences."""
SETTINGS = ("truncation", "padding")
"""tokenizer.json fields that are settings, not the pipeline: the server sets them from the model's own."""

log = logging.getLogger(__name__)


class LibraryTokenizerError(UnusableSource):
    """transformers cannot load the folder's tokenizer, so no reference library can answer for it."""


def library_tokenizer(folder: Path) -> tuple[str, Tokenizer | None]:
    """The class transformers loads a folder's tokenizer as, and its `tokenizers` pipeline (None: it has none).

    Raises LibraryTokenizerError when transformers cannot load it.
    """
    import transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    try:
        loaded = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # whatever stops transformers: the library could not read the folder's texts either
        raise LibraryTokenizerError(
            f"transformers could not load the tokenizer of {folder}: {type(error).__name__}: {error}"
        ) from error
    return type(loaded).__name__, getattr(loaded, "backend_tokenizer", None)


def pipeline_parts(tokenizer: Tokenizer) -> dict[str, object]:
    """A tokenizer's pipeline as tokenizer.json holds it, without truncation and padding."""
    return {key: value for key, value in json.loads(tokenizer.to_str()).items() if key not in SETTINGS}


def first_difference(
    ours: Tokenizer, theirs: Tokenizer, inputs: Iterable[str | tuple[str, str]]
) -> tuple[int, str | tuple[str, str], list[str], list[str]] | None:
    """The first input (its index) the two tokenise differently, with both token sequences; None: all agree."""
    for index, item in enumerate(inputs):
        pair = item if isinstance(item, tuple) else (item,)
        our_tokens, their_tokens = ours.encode(*pair).tokens, theirs.encode(*pair).tokens
        if our_tokens != their_tokens:
            return index, item, our_tokens, their_tokens
    return None


def with_converted_tokenizer(checkpoint: Checkpoint, scratch: Path) -> Checkpoint:
    """The checkpoint with a tokenizer.json to serve, made from transformers' tokenizer, where the folder has none.

    Unchanged when the folder has tokenizer.json or no tokenizer at all (none of VOCABULARY_FILES: token input
    only). transformers builds its tokenizer from the folder's vocabulary (CLIPTokenizer from vocab.json and
    merges.txt); its `tokenizers` pipeline is written into `scratch` with the folder's tokenizer_config.json
    and special_tokens_map.json. LibraryTokenizerError, one line, where that tokenizer has no such pipeline
    (SiglipTokenizer: sentencepiece and a Python text clean-up), which the server could not run.
    """
    folder = checkpoint.tokenizer_folder
    if folder is None or (folder / "tokenizer.json").is_file():
        return checkpoint
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return checkpoint
    class_name, pipeline = library_tokenizer(folder)
    if pipeline is None:
        raise LibraryTokenizerError(
            f"{folder}: no tokenizer.json, and transformers' {class_name} tokenises in Python with no `tokenizers`"
            " pipeline to convert, so the server could not tokenise as the library does (a folder with the model's"
            " tokenizer.json is exported)"
        )
    target = scratch / CONVERTED_TOKENIZER_FOLDER
    target.mkdir()
    pipeline.save(str(target / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, target / name)
    log.info("%s: no tokenizer.json; transformers' %s pipeline is served and published", folder, class_name)
    return dataclasses.replace(checkpoint, tokenizer_folder=target)


def with_library_tokenizer(checkpoint: Checkpoint, scratch: Path, sentences_file: Path) -> Checkpoint:
    """The checkpoint with the library's tokenizer to serve and publish, where it differs from the folder's file.

    Unchanged when the checkpoint has no source folder or no tokenizer.json, when transformers' tokenizer
    has no `tokenizers` pipeline, or when that pipeline is the file's. Otherwise its tokenizer files are
    copied into `scratch` with tokenizer.json replaced by the library's, and one warning says where they differ
    (the gate sentences of `sentences_file`, numbered as the gate numbers them, then PROBE_TEXTS, then pairs of
    gate sentences).
    """
    folder = checkpoint.tokenizer_folder
    if checkpoint.folder is None or folder is None or not checkpoint.tokenizer_files:
        return checkpoint
    class_name, theirs = library_tokenizer(folder)
    if theirs is None:
        return checkpoint
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    our_parts, their_parts = pipeline_parts(ours), pipeline_parts(theirs)
    if our_parts == their_parts:
        return checkpoint
    target = scratch / LIBRARY_TOKENIZER_FOLDER
    target.mkdir()
    for file in checkpoint.tokenizer_files:
        shutil.copyfile(file, target / file.name)
    theirs.save(str(target / "tokenizer.json"))
    parts = ", ".join(key for key in {**our_parts, **their_parts} if our_parts.get(key) != their_parts.get(key))
    sentences = read_sentences(sentences_file)
    inputs = [*sentences, *PROBE_TEXTS, *itertools.pairwise(sentences)]
    difference = first_difference(ours, theirs, inputs)
    if difference is None:
        found = "no gate sentence, probe text or pair of them tokenises differently"
    else:
        index, item, our_tokens, their_tokens = difference
        where = f"input {index + 1}" if index < len(sentences) else "a probe text"
        where = "a pair of gate sentences" if isinstance(item, tuple) else where
        found = f"first at {where}: {item!r}: tokenizer.json {our_tokens}, the library {their_tokens}"
    log.warning(
        "%s: the folder's tokenizer.json is not what transformers' %s runs (it differs in %s); the library's is"
        " served and published; %s",
        folder,
        class_name,
        parts,
        found,
    )
    return dataclasses.replace(checkpoint, tokenizer_folder=target)
