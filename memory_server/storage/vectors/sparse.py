"""BM25 sparse vectors from Qdrant's own tokenizer, shared by both index backends."""

import re
import zlib

import qdrant_edge

from memory_server.storage.vectors import SparseVector

# Qdrant's multilingual tokenizer segments Chinese/Japanese but drops tokens made only of digits,
# which would lose order ids like "O-1001". A letter prefix keeps them as ordinary tokens; the
# same rewrite runs on documents and queries, so matching stays exact.
_BARE_NUMBER = re.compile(r"(?<![A-Za-z0-9])(\d+)")
# Dictionary segmentation keeps "吃火锅" as one word, so a search for "火锅" would miss it.
# Overlapping character pairs of each CJK run are added as extra terms (the classic CJK bigram
# approach), so any two-character word inside a longer one still matches.
_CJK_RUN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]{2,}")


def prepare(text: str) -> str:
    text = _BARE_NUMBER.sub(r"n\1", text)
    pairs = [run[i:i + 2] for run in _CJK_RUN.findall(text) for i in range(len(run) - 1)]
    return f"{text} {' '.join(pairs)}" if pairs else text


TIE_LEVELS = 4096
TIE_STEP = 2.0 ** -20  # 4-8 float32 steps of a weight: rounding can merge two factors, never swap them


def tie_break(memory_id: str) -> float:
    """A factor just above 1 (up to ~1 + 2^-8, in 4,096 steps), fixed by the memory's id, for its BM25 weights.
    Equal BM25 scores are common in short texts, and Qdrant ranks them in no fixed order, which
    differs between two indexes of the same memories (two replicas, an index before and after a
    rebuild): a hybrid search then fused them into different answers (bench/analysis.md, round 24).
    Scaled like this, memories that would tie rank by their ids' factors, alike everywhere."""
    return 1.0 + (zlib.crc32(memory_id.encode()) % TIE_LEVELS + 1) * TIE_STEP


class SparseEncoder:
    def __init__(self) -> None:
        self._bm25 = qdrant_edge.Bm25(qdrant_edge.Bm25Config(tokenizer=qdrant_edge.TokenizerType.Multilingual))

    def document(self, text: str, memory_id: str) -> SparseVector:
        vector = self._bm25.embed_document(prepare(text))
        factor = tie_break(memory_id)
        return SparseVector(list(vector.indices), [value * factor for value in vector.values])

    def query(self, text: str) -> SparseVector:
        vector = self._bm25.embed_query(prepare(text))
        return SparseVector(list(vector.indices), list(vector.values))

