"""The registry of task heads: a head is its module and one line in HEADS, and export/ asks the registry.

Fast checks of the declarations themselves; each head's export end to end is its own test file
(test_heads.py for classifiers, test_splade.py, test_colbert.py, test_bge_m3.py, test_gemma.py, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

from export.families.bert import EncoderConfig
from export.heads.head import SEQUENCE, GraphOutput
from export.heads.registry import HEADS, graph_outputs
from tests.export.tiny_models import HEADS as ATTENTION_HEADS
from tests.export.tiny_models import HIDDEN, LAYERS, VOCAB_SIZE

EXPORT = Path(__file__).resolve().parents[2] / "export"
SHARED_HEAD_MODULES = {"export.heads.head", "export.heads.registry"}
"""What export/ outside heads/ may import from heads/: the declaration's type and the registry."""


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_each_head_is_listed_once_with_its_own_configuration_type() -> None:
    assert len({head.name for head in HEADS}) == len(HEADS)
    assert len({head.config_type for head in HEADS}) == len(HEADS)


def test_nothing_in_export_outside_heads_names_a_head() -> None:
    """A new head touches its module and HEADS only: export/ reaches heads through the registry."""
    head_modules = {f"export.heads.{path.stem}" for path in (EXPORT / "heads").glob("*.py")} - SHARED_HEAD_MODULES
    naming = {
        str(path.relative_to(EXPORT.parent)): sorted(_imported_modules(path) & head_modules)
        for path in EXPORT.rglob("*.py")
        if (EXPORT / "heads") not in path.parents
    }
    assert {path: modules for path, modules in naming.items() if modules} == {}


def test_a_plain_embedder_answers_its_hidden_states_and_embedding() -> None:
    config = EncoderConfig(
        vocab_size=VOCAB_SIZE, d_model=HIDDEN, num_heads=ATTENTION_HEADS, num_layers=LAYERS, ffn_dim=4 * HIDDEN
    )
    assert graph_outputs(config, None) == (
        GraphOutput("last_hidden_state", (SEQUENCE, config.d_model)),
        GraphOutput("embedding", (config.d_model,)),
    )
