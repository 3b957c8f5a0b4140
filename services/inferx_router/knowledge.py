"""`vector_search`, the built-in example tool: cosine similarity over TF-IDF vectors of
a small document set (examples/knowledge_base.jsonl). Deterministic and fast, so the
example chain runs anywhere; a real vector database plugs in as a ToolService."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_WORD = re.compile(r"[a-z0-9]+")


def _terms(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


class KnowledgeBase:
    def __init__(self, documents: list[Document]) -> None:
        self.documents = documents
        doc_freq: Counter[str] = Counter()
        for doc in documents:
            doc_freq.update(set(_terms(doc.title + " " + doc.text)))
        n = max(len(documents), 1)
        self._idf = {t: math.log((1 + n) / (1 + df)) + 1 for t, df in doc_freq.items()}
        self._vectors = [self._vector(doc.title + " " + doc.text) for doc in documents]

    @classmethod
    def load(cls, path: Path) -> KnowledgeBase:
        documents = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                documents.append(Document(str(row["id"]), str(row.get("title", "")), str(row["text"])))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a document ({exc})") from None
        return cls(documents)

    def _vector(self, text: str) -> dict[str, float]:
        counts = Counter(_terms(text))
        vec = {t: c * self._idf.get(t, 0.0) for t, c in counts.items()}
        norm = math.sqrt(sum(v * v for v in vec.values())) or 1.0
        return {t: v / norm for t, v in vec.items()}

    def search(self, query: str, top_k: int = 3) -> list[dict[str, object]]:
        q = self._vector(query)
        scored = [(sum(w * vec.get(t, 0.0) for t, w in q.items()), i) for i, vec in enumerate(self._vectors)]
        scored.sort(key=lambda s: (-s[0], s[1]))
        return [
            {
                "id": self.documents[i].doc_id,
                "title": self.documents[i].title,
                "text": self.documents[i].text,
                "score": round(score, 4),
            }
            for score, i in scored[:top_k]
            if score > 0
        ]
