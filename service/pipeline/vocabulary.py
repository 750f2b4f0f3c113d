"""The names a request and its answer use: inputs, parameters and served outputs, the same for every protocol.

Front ends spell their fields with these (a JSON body's `dimensions` is the `dimensions` parameter);
the pipeline checks requests and makes outputs by them. The graph's own per-position outputs
(`token_vectors`, `token_weights`) and the `adapter_ids` input are the repository's
(service.core.repository).
"""

from __future__ import annotations

# Inputs.
TEXT_INPUT = "text"
QUERY_INPUT = "query"
"""The optional first member of each pair, for a classifier or a multi-vector model: row i is (query[i], text[i])."""
IMAGE_INPUT = "image"
"""A two-tower model's images: one encoded image (PNG, JPEG, WebP, GIF) per element, in place of texts."""
REQUIRED_TOKEN_INPUTS = ("input_ids", "attention_mask")
"""Token inputs a token request must carry; token_type_ids defaults to zeros."""

# Parameters.
PROMPT_NAME = "prompt_name"
TASK = "task"
"""A model's task adapter (jina-embeddings-v3's retrieval.query …), as Jina's API names the choice."""
TRUNCATE = "truncate"
DIMENSIONS = "dimensions"
LATE_CHUNKING = "late_chunking"
INSTRUCTION = "instruction"
"""A reranker's instruction for its pair template (Qwen3-Reranker's <Instruct>), in place of its default."""
ADD_SPECIAL_TOKENS = "add_special_tokens"
"""Whether the token outputs hold the special tokens the model adds (default true), as TEI's /tokenize asks."""
INPUT_TYPE = "input_type"
"""Whether a multi-vector model's texts are queries or documents (service.pipeline.multivector)."""
TOP_K = "top_k"
"""A sparse embedding's terms to keep per row (service.pipeline.sparse)."""
PRIORITY = "priority"
"""The priority a request's rows wait at, 1 the highest (Triton's `priority` parameter; 0: the default)."""
TIMEOUT = "timeout"
"""How long a request may wait in the queue, microseconds (Triton's `timeout` parameter; 0: no bound)."""
SCHEDULING = (PRIORITY, TIMEOUT)
"""The parameters that place a request in the queue: every protocol takes them (JSON bodies as fields)."""

# Outputs.
EMBEDDING = "embedding"
TOKEN_STATES = "last_hidden_state"
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary")
"""Every form of the embedding, as Cohere's `embedding_types` and sentence-transformers' `precision` name them."""
OUTPUT_OF_TYPE = {"float": EMBEDDING, **{kind: f"{EMBEDDING}_{kind}" for kind in EMBEDDING_TYPES[1:]}}
"""Each form's served output name (service.pipeline.embedding_types)."""
CHUNKS = "chunk_embeddings"
"""Each window's own vector, texts' windows in order (`truncate` false: service.pipeline.long_texts)."""
CHUNK_COUNTS = "chunk_counts"
"""Each text's windows (1 for a text within the model's length)."""
SPARSE = "sparse_embedding"
"""A SPLADE model's graph output [rows, vocab_size] (service.pipeline.sparse)."""
INDICES = "sparse_indices"
VALUES = "sparse_values"
MULTIVECTOR = "multivector"
MULTIVECTOR_LENGTHS = "multivector_lengths"
SCORE = "score"
"""A (query, text) pair's MaxSim, from a multi-vector model (service.pipeline.multivector)."""
TOKENS = "tokens"
"""The source of the token outputs: the request's texts as the model's tokenizer reads them (no graph output)."""
TOKEN_IDS = "token_ids"
"""Each text's token ids, padded with -1."""
TOKEN_OFFSETS = "token_offsets"
"""Each token's [start, stop) in its text (characters, the prompt's prefix included); (-1, -1) for special tokens
and padding."""
TOKEN_COUNTS = "token_counts"
"""Each text's tokens."""
TOKEN_OUTPUTS = (TOKEN_IDS, TOKEN_OFFSETS, TOKEN_COUNTS)
