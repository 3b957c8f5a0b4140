"""The built-in vector_search tool and the tool-cache key."""

from pathlib import Path

import pytest

from inferx_router.knowledge import KnowledgeBase
from inferx_router.tools import cache_key

ROOT = Path(__file__).resolve().parents[2]


def test_search_ranks_the_relevant_document_first() -> None:
    kb = KnowledgeBase.load(ROOT / "examples" / "knowledge_base.jsonl")
    assert kb.search("Where is my order?")[0]["id"] == "order-status"
    assert kb.search("how do I get a refund")[0]["id"] == "refund-policy"
    assert kb.search("zzzz qqqq") == []
    assert len(kb.search("order", top_k=2)) == 2


def test_bad_document_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "kb.jsonl"
    path.write_text('{"id": "a", "text": "ok"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="kb.jsonl:2"):
        KnowledgeBase.load(path)


def test_cache_key_is_canonical_and_versioned() -> None:
    assert cache_key("t", "1", {"a": 1, "b": [1, 2]}) == cache_key("t", "1", {"b": [1, 2], "a": 1})
    assert cache_key("t", "1", {"a": 1}) != cache_key("t", "2", {"a": 1})
    assert cache_key("t", "1", {"a": 1}) != cache_key("u", "1", {"a": 1})
