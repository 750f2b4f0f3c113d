"""Text -> token ids, configured from the model's own settings.

The bundled tokenizer.json of sentence-transformers models often carries truncation and fixed
padding to 128; the model is served with its own max sequence length. The server takes each
text's tokens at their own length (`encode_rows`); the batcher pads each batch to its longest.
`encode` pads a list of texts to its longest, as sentence-transformers does, for clients that
send token ids.

Texts far longer than the model can read are clipped before tokenisation, to a prefix that is
proven to give the same tokens (see `TextTokenizer.clip`): a 100,000-character text costs about
as much as a 2,000-character one.

Pairs (a reranker's query and document) are tokenised as the model's tokenizer pairs them (its
post-processor: `[CLS] a [SEP] b [SEP]` with segment ids, or `<s> a </s></s> b </s>`), the
longer member truncated first. Pair members are not clipped: which member is longer decides
where truncation cuts, so they are tokenised whole (the request's byte limits bound the cost).
A reranker that reads a prompt (Qwen3-Reranker) has a pair template instead (the repository's
`PairTemplate`): prefix + the middle holding instruction, query and document + suffix, the prefix
and suffix kept whole and the middle cut at its end, as its model card builds a pair.

With `truncate=False` a pair longer than the model's maximum is refused instead of cut; a single
text is split into windows instead (`encode_windows`: each at most the model's length with its
special tokens, consecutive windows sharing `overlap` tokens), which the pipeline embeds as
ordinary rows and combines.

`decode` turns token ids back into text (TEI's /decode), refusing ids outside the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from service.core.repository import ModelSpec
from service.core.rows import TokenRows
from service.core.text_rules import PairTemplate
from service.errors import InvalidArgument

Pair = tuple[str, str]


@dataclass(frozen=True)
class TokenizedBatch:
    """Token ids of several texts, padded to the longest; all arrays int64 [rows, length]."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray

    @property
    def adapter_ids(self) -> np.ndarray:
        """No task adapter for any token (a model with task adapters takes the ids of the tasks asked for)."""
        return np.zeros_like(self.input_ids)

    def feed(
        self, input_names: Sequence[str] = ("input_ids", "attention_mask", "token_type_ids")
    ) -> dict[str, np.ndarray]:
        """The arrays by graph input name (only the names asked for)."""
        return {name: getattr(self, name) for name in input_names}


@dataclass(frozen=True)
class Token:
    """One token of a text: its id, its text, whether it is a special token, and where it lies (characters)."""

    id: int
    text: str
    special: bool
    start: int
    stop: int


CLIP_CHARS_PER_TOKEN = 8
"""First clipping window, in characters per token of max_length (enough for most prose)."""
CLIP_GROWTH = 4
"""Factor the window grows by when it holds too few words."""


class TextTokenizer:
    """A `tokenizers` tokenizer with truncation at max_length: texts as rows of their own length, or padded."""

    def __init__(
        self, path: Path, max_length: int, pad_token_id: int | None = None, pair_template: PairTemplate | None = None
    ) -> None:
        """pad_token_id None: the id the file gives its pad token; pair_template None: the file's own pair form.

        A pair template whose prefix and suffix leave no token of max_length for the middle is refused (ValueError).
        """
        self._tokenizer = Tokenizer.from_file(str(path))
        self._max_length = max_length
        padding = self._tokenizer.padding or {}
        if pad_token_id is None:
            pad_token_id = padding.get("pad_id", self._tokenizer.token_to_id(padding.get("pad_token", "[PAD]")) or 0)
        self.pad_token_id = pad_token_id
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_length)
        self._clip_from = CLIP_CHARS_PER_TOKEN * max_length
        """Texts up to this many characters are never clipped (checked before any other work)."""
        self._windowed: dict[int, Tokenizer] = {}
        """Copies truncating with a stride, by overlap, made on first use (`encode_windows`)."""
        self._truncating: dict[int, Tokenizer] = {}
        """Copies truncating at other lengths (a late-interaction model's queries and documents, a pair template's
        middle), made on first use."""
        self._untruncated: Tokenizer | None = None
        """The same tokenizer without truncation, made when a refusal needs a text's full count."""
        self._known_ids: np.ndarray | None = None
        """Whether each id from 0 to the largest is in the vocabulary (added tokens included), made on first decode."""
        self._pair_template = pair_template
        self._template_ends: tuple[list[int], list[int]] = ([], [])
        """The pair template's prefix and suffix as token ids (tokenised alone, without special tokens)."""
        if pair_template is not None:
            whole = self._whole()
            prefix, suffix = (
                whole.encode(end, add_special_tokens=False).ids for end in (pair_template.prefix, pair_template.suffix)
            )
            self._template_ends = (prefix, suffix)
            if len(prefix) + len(suffix) >= max_length:
                raise ValueError(
                    f"the pair template's prefix and suffix take {len(prefix) + len(suffix)} tokens, leaving none of"
                    f" the model's {max_length} for the query and document"
                )

    @classmethod
    def of_model(cls, spec: ModelSpec) -> TextTokenizer:
        """The tokenizer a served model reads its texts with: its file, length, pad id and pair template."""
        if spec.tokenizer_file is None:
            raise ValueError(f"model {spec.name} has no tokenizer: it takes token ids")
        return cls(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id, spec.pair_template)

    def clip(self, text: str) -> str:
        """A prefix of `text` that tokenises (after truncation at max_length) exactly as `text` does.

        Why it is exact: the normaliser works character by character, so normalising a prefix
        gives a prefix of the normalised text, except at the cut; the pre-tokeniser splits that
        into words, and every word becomes at least one token. A prefix holding max_length + 2
        words therefore holds max_length whole words, untouched by the cut, which already give
        every token that truncation keeps. When a window holds fewer words (very long words,
        long runs of spaces or removed characters), it grows; the whole text is the last resort.
        Tokenizers without a pre-tokeniser are never clipped.
        """
        if len(text) <= self._clip_from:
            return text
        normalizer, pre_tokenizer = self._tokenizer.normalizer, self._tokenizer.pre_tokenizer
        if pre_tokenizer is None:
            return text
        window = self._clip_from
        while len(text) > window:
            prefix = text[:window]
            normalized = normalizer.normalize_str(prefix) if normalizer is not None else prefix
            if len(pre_tokenizer.pre_tokenize_str(normalized)) >= self._max_length + 2:
                return prefix
            window *= CLIP_GROWTH
        return text

    @property
    def max_length(self) -> int:
        """The most tokens a sequence is given (special tokens included)."""
        return self._max_length

    @property
    def window_tokens(self) -> int:
        """The tokens of a text one sequence holds (max_length less the special tokens the model adds)."""
        return self._max_length - self._tokenizer.num_special_tokens_to_add(is_pair=False)

    def encode_rows(self, texts: list[str], truncate: bool = True) -> TokenRows:
        """Tokenise texts (with special tokens), each row at its own length.

        truncate False: a text longer than max_length is refused (InvalidArgument) rather than cut.
        """
        if len(texts) == 1 and truncate:  # no thread pool: cheaper (docs/decisions.md#single-text-tokenisation)
            ids = np.array(self._tokenizer.encode(self.clip(texts[0])).ids, dtype=np.int64)
            return TokenRows(ids, np.array([len(ids)], dtype=np.int64), len(ids))
        # Without character offsets, which nothing here reads: less CPU (docs/decisions.md#tokenising-without-offsets).
        encodings = self._tokenizer.encode_batch_fast([self.clip(text) for text in texts])
        if not truncate:
            self._refuse_truncated(encodings, texts)
        return _rows(encodings, with_types=False)

    def encode_windows(self, texts: list[str], overlap: int) -> tuple[TokenRows, np.ndarray]:
        """Texts as windows of at most max_length tokens (special tokens in each), consecutive ones sharing `overlap`.

        Returns every window as a row (each text's in order, texts in order) and each text's window count.
        A text within max_length is one window, the row `encode_rows` gives it.
        """
        if overlap >= self.window_tokens:
            raise InvalidArgument(
                f"texts longer than the model cannot be split: the server's --chunk-overlap-tokens {overlap} leaves no"
                f" room in its windows of {self.window_tokens} tokens (its length less its special tokens)"
            )
        windowed = self._windowed.get(overlap)
        if windowed is None:
            windowed = Tokenizer.from_str(self._tokenizer.to_str())
            windowed.enable_truncation(max_length=self._max_length, stride=overlap)
            self._windowed[overlap] = windowed
        encodings = windowed.encode_batch_fast(texts)
        windows = [[encoding, *encoding.overflowing] for encoding in encodings]
        counts = np.fromiter(map(len, windows), dtype=np.int64, count=len(windows))
        return _rows(list(itertools.chain.from_iterable(windows)), with_types=False), counts

    def encode_marked_rows(
        self,
        texts: list[str],
        length: int,
        prefix_id: int | None,
        expansion_id: int | None = None,
        attend_expansion: bool = False,
    ) -> TokenRows:
        """Texts as a late-interaction model reads them (PyLate's ColBERT): rows of at most `length` tokens.

        Each text is truncated to `length` less one for the prefix, then `prefix_id` (if any) goes after its
        first token. With `expansion_id`, each row is padded to `length` with it, those tokens unattended
        unless `attend_expansion` (ColBERT's query expansion); their vectors are kept all the same.
        """
        truncating = self._truncating_at(length - (prefix_id is not None))
        encodings = truncating.encode_batch_fast([self.clip(text) for text in texts])
        rows = [e.ids if prefix_id is None else [*e.ids[:1], prefix_id, *e.ids[1:]] for e in encodings]
        if expansion_id is None:
            lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
            ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
            return TokenRows(ids, lengths, int(lengths.max()))
        ids = np.full((len(rows), length), expansion_id, dtype=np.int64)
        mask = np.full((len(rows), length), int(attend_expansion), dtype=np.int64)
        for row, own in enumerate(rows):
            ids[row, : len(own)] = own
            mask[row, : len(own)] = 1
        lengths = np.full(len(rows), length, dtype=np.int64)
        return TokenRows(ids.ravel(), lengths, length, None if attend_expansion else mask.ravel())

    def _truncating_at(self, length: int) -> Tokenizer:
        """A copy truncating at `length` tokens (special tokens included), made on first use."""
        truncating = self._truncating.get(length)
        if truncating is None:
            truncating = Tokenizer.from_str(self._tokenizer.to_str())
            truncating.enable_truncation(max_length=length)
            self._truncating[length] = truncating
        return truncating

    @property
    def pair_template(self) -> PairTemplate | None:
        """The pair template pairs are made with; None: the tokenizer's own pair form."""
        return self._pair_template

    def encode_pair_rows(self, pairs: list[Pair], truncate: bool = True, instruction: str | None = None) -> TokenRows:
        """Tokenise (a, b) pairs, each row at its own length: by the pair template, or as the tokenizer pairs them.

        The tokenizer's own pair form gives segment ids.
        instruction: the template's instruction for these pairs (None: its default); only with a pair template.
        """
        if self._pair_template is not None:
            return self._templated_rows(pairs, truncate, instruction)
        if instruction is not None:
            raise InvalidArgument("this model has no pair template: its pairs take no instruction")
        encodings = self._tokenizer.encode_batch_fast(pairs)
        if not truncate:
            self._refuse_truncated(encodings, pairs)
        return _rows(encodings, with_types=True)

    def _templated_rows(self, pairs: list[Pair], truncate: bool, instruction: str | None) -> TokenRows:
        """Pairs by the pair template: prefix, the filled middle cut at its end to the room left, suffix."""
        prefix, suffix = self._template_ends
        room = self._max_length - len(prefix) - len(suffix)
        middles = [self._pair_template.filled(query, document, instruction) for query, document in pairs]
        encodings = self._truncating_at(room).encode_batch_fast(middles)
        if not truncate:
            for row, encoding in enumerate(encodings):
                if encoding.overflowing:
                    whole = len(prefix) + len(self._whole().encode(middles[row])) + len(suffix)
                    raise InvalidArgument(
                        f"pair {row} has {whole} tokens with its template, more than the model's {self._max_length},"
                        " and truncate is false"
                    )
        lengths = np.fromiter((len(prefix) + len(e) + len(suffix) for e in encodings), dtype=np.int64, count=len(pairs))
        rows = itertools.chain.from_iterable(itertools.chain(prefix, e.ids, suffix) for e in encodings)
        ids = np.fromiter(rows, dtype=np.int64, count=int(lengths.sum()))
        return TokenRows(ids, lengths, int(lengths.max()))

    def encode_chunks(self, chunks: list[str]) -> tuple[TokenRows, np.ndarray]:
        """Late chunking: consecutive chunks of one document as one row, and each chunk's [start, stop) in it.

        Each chunk is tokenised alone, without special tokens; their tokens are laid end to end
        between the model's special tokens. A document over max_length, or a chunk of no tokens, is
        refused (InvalidArgument).
        """
        whole = self._whole()
        encodings = whole.encode_batch_fast(chunks, add_special_tokens=False)
        empty = next((index for index, encoding in enumerate(encodings) if not len(encoding)), None)
        if empty is not None:
            raise InvalidArgument(f"late chunking: chunk {empty} has no tokens")
        document = whole.post_process(Encoding.merge(encodings, growing_offsets=True))
        if len(document) > self._max_length:
            raise InvalidArgument(
                f"late chunking: the {len(chunks)} chunks make a document of {len(document)} tokens, more than the"
                f" model's {self._max_length}; send fewer or shorter chunks"
            )
        counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        first = document.special_tokens_mask.index(0)
        starts = first + np.concatenate([[0], np.cumsum(counts)[:-1]])
        ids = np.array(document.ids, dtype=np.int64)
        return TokenRows(ids, np.array([len(ids)], dtype=np.int64), len(ids)), np.stack([starts, starts + counts], 1)

    def count_tokens(self, text: str | Pair) -> int:
        """Tokens of a text or pair before any truncation (special tokens included)."""
        whole = self._whole()
        return len(whole.encode(*text) if isinstance(text, tuple) else whole.encode(text))

    def _whole(self) -> Tokenizer:
        """The same tokenizer without truncation (made on first use)."""
        if self._untruncated is None:
            self._untruncated = Tokenizer.from_str(self._tokenizer.to_str())
            self._untruncated.no_truncation()
        return self._untruncated

    def _refuse_truncated(self, encodings: list, inputs: Sequence[str | Pair]) -> None:
        """InvalidArgument naming the first input that truncation cut."""
        for row, encoding in enumerate(encodings):
            if encoding.overflowing:
                kind = "pair" if isinstance(inputs[row], tuple) else "text"
                raise InvalidArgument(
                    f"{kind} {row} has {self.count_tokens(inputs[row])} tokens, more than the model's"
                    f" {self._max_length}, and truncate is false"
                )

    def tokens(self, text: str, add_special_tokens: bool = True) -> list[Token]:
        """The tokens of one text (truncated at max_length), each with its piece of the text."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [
            Token(token_id, text[start:stop] if not special else piece, bool(special), start, stop)
            for token_id, piece, special, (start, stop) in zip(
                encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets, strict=True
            )
        ]

    def token_table(
        self, texts: list[str], add_special_tokens: bool = True, truncate: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each text's tokens as arrays: ids, character offsets and counts.

        ids: int64 [texts, width] padded with -1; offsets: int64 [texts, width, 2], each token's
        [start, stop) in its text, (-1, -1) for special tokens and padding; counts: int64 [texts, 1].
        truncate False: every token of the text, however long; else at most max_length.
        """
        if truncate:
            encodings = self._tokenizer.encode_batch(
                [self.clip(text) for text in texts], add_special_tokens=add_special_tokens
            )
        else:
            encodings = self._whole().encode_batch(texts, add_special_tokens=add_special_tokens)
        counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        width = int(counts.max(initial=0))
        ids = np.full((len(texts), width), -1, dtype=np.int64)
        offsets = np.full((len(texts), width, 2), -1, dtype=np.int64)
        for row, encoding in enumerate(encodings):
            count = counts[row]
            ids[row, :count] = encoding.ids
            placed = np.array(encoding.offsets, dtype=np.int64).reshape(count, 2)
            placed[np.array(encoding.special_tokens_mask, dtype=bool)] = -1
            offsets[row, :count] = placed
        return ids, offsets, counts[:, None]

    def decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each sequence of token ids (special tokens left out unless asked for).

        An id outside the vocabulary is refused (InvalidArgument naming its sequence and place):
        `tokenizers` would silently drop it.
        """
        known = self._known_ids
        if known is None:
            vocabulary = list(self._tokenizer.get_vocab(with_added_tokens=True).values())
            known = np.zeros(max(vocabulary) + 1, dtype=bool)
            known[vocabulary] = True
            self._known_ids = known
        for row, ids in enumerate(sequences):
            # min and max first: ids past int64 must not reach numpy.
            if ids and (min(ids) < 0 or max(ids) >= known.size or not known[np.array(ids, dtype=np.int64)].all()):
                place, bad = next((i, t) for i, t in enumerate(ids) if not (0 <= t < known.size and known[t]))
                raise InvalidArgument(
                    f"sequence {row}, position {place}: token id {bad} is not in the tokenizer's vocabulary"
                    f" ({int(known.sum())} tokens, ids 0 to {known.size - 1})"
                )
        return self._tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def encode(self, texts: list[str]) -> TokenizedBatch:
        """Tokenise texts (with special tokens) into one batch padded to the longest."""
        padded = self.encode_rows(texts).padded(self.pad_token_id)
        return TokenizedBatch(padded["input_ids"], padded["attention_mask"], padded["token_type_ids"])

    def encode_pairs(self, pairs: list[Pair], instruction: str | None = None) -> TokenizedBatch:
        """Tokenise pairs into one batch padded to the longest, segment ids included (encode_pair_rows's forms)."""
        padded = self.encode_pair_rows(pairs, instruction=instruction).padded(self.pad_token_id)
        return TokenizedBatch(padded["input_ids"], padded["attention_mask"], padded["token_type_ids"])


def _rows(encodings: list, with_types: bool) -> TokenRows:
    """Encodings as token rows (segment ids kept when asked for and not all zero)."""
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=total)
    types = None
    if with_types:
        types = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encodings), dtype=np.int64, count=total)
        if not types.any():
            types = None
    return TokenRows(ids, lengths, int(lengths.max()), token_type_ids=types)
