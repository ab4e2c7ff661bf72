"""BM25 sparse vectors from Qdrant's own tokenizer, shared by both index backends."""

import re

import qdrant_edge

from memory_server.storage.vectors import SparseVector

# Qdrant's multilingual tokenizer segments Chinese/Japanese but drops tokens made only of digits,
# which would lose order ids like "O-1001". A letter prefix keeps them as ordinary tokens; the
# same rewrite runs on documents and queries, so matching stays exact.
_BARE_NUMBER = re.compile(r"(?<![A-Za-z0-9])(\d+)")


class SparseEncoder:
    def __init__(self) -> None:
        self._bm25 = qdrant_edge.Bm25(qdrant_edge.Bm25Config(tokenizer=qdrant_edge.TokenizerType.Multilingual))

    @staticmethod
    def _prepare(text: str) -> str:
        return _BARE_NUMBER.sub(r"n\1", text)

    def document(self, text: str) -> SparseVector:
        vector = self._bm25.embed_document(self._prepare(text))
        return SparseVector(list(vector.indices), list(vector.values))

    def query(self, text: str) -> SparseVector:
        vector = self._bm25.embed_query(self._prepare(text))
        return SparseVector(list(vector.indices), list(vector.values))
