"""The llama.cpp worker of ``mlx-tracer bench`` (started by :class:`mlx_tracer.bench.peer.PeerWorker`).

Run as a script, ``PYTHON peer_worker.py``, by a Python that has
``llama_cpp`` (llama-cpp-python, built from source for this CPU: the
``peer`` extra, or another venv named by ``--peer-python``); it needs no mlx
and no mlx-tracer, only the standard library, numpy and ``llama_cpp``, and
loads :mod:`.protocol` by path. It measures what the bench measures for its
other systems, through llama.cpp's C API (llama-cpp-python's ctypes
functions; the high-level ``Llama`` class has no multi-sequence decode):

* ``load``: one GGUF file, ``threads`` threads for decode and batches;
* ``decode``: ``bucket`` independent sequences (one KV stream each), each
  holding the same ``context`` tokens, then one untimed call with the
  request's first tokens (the bench's other systems take them as a 1-token
  prompt), then ``tokens - 1`` timed steps, each ONE ``llama_decode`` of
  ``bucket`` tokens and a greedy argmax of each sequence's logits: tokens/s.
  A context is made and prefilled once per (bucket, context) and trimmed back
  to ``context`` positions before each run (``llama_memory_seq_rm``);
* ``window``: what a speculative verify window costs it (one decode call of
  L tokens a sequence, logits for each) against a decode call of 1, at a
  bucket and context (``benchmarks/spec_ceiling.py --peer-python``);
* the peak memory of each run: the process's resident-set high-water mark
  (``VmHWM`` of ``/proc/self/status``, reset before the run by writing 5 to
  ``/proc/self/clear_refs``; where that is refused, ``ru_maxrss``, the
  process's lifetime peak). It covers the model file's pages the run touched
  (llama.cpp maps the file), the KV cache, llama.cpp's buffers and this
  Python (about 30 MB).

Its stdout is the protocol's channel alone: file descriptor 1 is moved aside
and llama.cpp's own output goes to stderr.
"""

import ctypes
import importlib.util
import os
import resource
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    del sys.path[0]  # the bench's modules beside this file are no top-level modules of this Python

# A text to tokenize for the contexts (decode speed does not depend on which tokens).
SENTENCE = ("The quick brown fox jumps over the lazy dog while the farmer counts "
            "his sheep in the green field near the old stone bridge. ")


def _load_protocol():
    spec = importlib.util.spec_from_file_location("_mlx_tracer_bench_protocol", os.path.join(_HERE, "protocol.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reset_peak() -> bool:
    """Reset the resident-set high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    """The resident-set high-water mark in MB (``VmHWM``, else ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # kB on Linux


class LlamaCpp:
    """One model and one context of llama.cpp, driven one request at a time."""

    def __init__(self):
        self.L, self.np, self.why = None, None, None
        try:
            import llama_cpp as L
            import numpy as np
        except Exception as e:  # the bench reports it and skips its llama.cpp column
            self.why = f"{type(e).__name__}: {e}"
        else:
            self.L, self.np = L, np
            self._log = L.llama_log_callback(lambda level, text, _: None)  # kept: llama.cpp holds the pointer
            L.llama_log_set(self._log, ctypes.c_void_p(0))
            L.llama_backend_init()
        self.model = self.ctx = self.batch = None
        self.shape = None  # (bucket, positions per sequence, context) of self.ctx
        self.threads = 1

    def _need(self):
        if self.L is None:
            raise RuntimeError(f"llama_cpp is not importable by {sys.executable}: {self.why}")

    def _need_model(self):
        self._need()
        if self.model is None:
            raise ValueError("no model loaded")

    def hello(self) -> dict:
        self._need()
        return {"version": getattr(self.L, "__version__", "?"), "python": sys.executable,
                "system_info": self.L.llama_print_system_info().decode(errors="replace").strip()}

    def _free_context(self):
        if self.batch is not None:
            self.L.llama_batch_free(self.batch)
        if self.ctx is not None:
            self.L.llama_free(self.ctx)
        self.ctx = self.batch = self.shape = None

    def load(self, path: str, threads: int) -> dict:
        self._need()
        L = self.L
        self._free_context()
        if self.model is not None:
            L.llama_model_free(self.model)
            self.model = None
        model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.model, self.threads = model, threads
        self.vocab = L.llama_model_get_vocab(model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.text = self._tokenize(SENTENCE)
        return {"n_vocab": self.n_vocab, "file_bytes": os.path.getsize(path)}

    def _tokenize(self, text: str, bos: bool = False) -> list:
        raw = text.encode()
        buf = (self.L.llama_token * (len(raw) + 16))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, len(raw) + 16, bos, False)
        if n < 0:
            raise RuntimeError("llama_tokenize failed")
        return list(buf[:n])

    def _context(self, B: int, C: int, tokens: int):
        """A context for B sequences of C + tokens positions, its sequences holding the context."""
        per_seq = -(-(C + tokens + 8) // 256) * 256
        if self.shape == (B, per_seq, C):
            return
        L = self.L
        self._free_context()
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = B * per_seq, B
        cp.n_threads = cp.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {B} x {per_seq} positions")
        self.ctx, self.n_batch = ctx, L.llama_n_batch(ctx)
        self.batch = L.llama_batch_init(max(self.n_batch, B), 0, 1)
        self.mem = L.llama_get_memory(ctx)
        L.llama_memory_clear(self.mem, True)
        ids = self._tokenize("", bos=True) + self.text * (C // max(1, len(self.text)) + 1)
        ids = ids[:C]
        self._prefill(ids, 0)
        for s in range(1, B):  # the same context in every sequence: copied where llama.cpp can, else prefilled
            L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
            if L.llama_memory_seq_pos_max(self.mem, s) != C - 1:
                L.llama_memory_seq_rm(self.mem, s, -1, -1)
                self._prefill(ids, s)
        L.llama_synchronize(ctx)
        self.shape = (B, per_seq, C)

    def _decode(self, entries):
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _prefill(self, ids, seq):
        for off in range(0, len(ids), self.n_batch):
            chunk = ids[off:off + self.n_batch]
            self._decode([(t, off + i, seq, off + i == len(ids) - 1) for i, t in enumerate(chunk)])

    def _back_to_context(self, B: int, C: int):
        """Trims each of the B sequences back to its C context positions (and checks it holds them)."""
        for s in range(B):
            self.L.llama_memory_seq_rm(self.mem, s, C, -1)
            if self.L.llama_memory_seq_pos_max(self.mem, s) != C - 1:
                raise RuntimeError(f"llama.cpp's sequence {s} did not go back to its {C} context positions")

    def _argmax(self, i: int) -> int:
        logits = self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def decode(self, bucket: int, context: int, tokens: int, first: list) -> dict:
        """One run: tokens/s of ``tokens - 1`` timed steps (at least 1) and the run's peak memory."""
        self._need_model()
        B, C, L = bucket, context, self.L
        self._context(B, C, tokens)
        self._back_to_context(B, C)
        exact = reset_peak()
        cur = [int(t) % self.n_vocab for t in first[:B]] + [0] * (B - len(first))
        self._decode([(cur[s], C, s, True) for s in range(B)])  # the 1-token prompt, untimed
        cur = [self._argmax(s) for s in range(B)]
        steps = max(1, tokens - 1)
        t0 = time.perf_counter()
        for step in range(steps):
            self._decode([(cur[s], C + 1 + step, s, True) for s in range(B)])
            cur = [self._argmax(s) for s in range(B)]
        L.llama_synchronize(self.ctx)
        dt = time.perf_counter() - t0
        return {"tps": B * steps / dt, "peak_mb": peak_mb(),
                "peak_kind": "VmHWM" if exact else "ru_maxrss (the process's lifetime peak)"}

    def window(self, bucket: int, context: int, lengths: list, reps: int) -> dict:
        """What a verify window costs llama.cpp: ``bucket`` sequences at
        ``context`` positions, ONE ``llama_decode`` of L tokens a sequence
        (logits for each, each read and its argmax taken, as a verifier
        does) for each L of ``lengths`` and for L = 1 (a decode step), rolled
        back to the context after each call; the lengths take turns, ``reps``
        calls each after two untimed rounds. ``{"ms": {L: median ms}}``."""
        self._need_model()
        B, C, L = bucket, context, self.L
        sizes = [1] + sorted({int(n) for n in lengths if int(n) > 1})
        n_batch = L.llama_context_default_params().n_batch  # the contexts' (_context keeps the default)
        if B * sizes[-1] > n_batch:
            raise ValueError(f"a window of {sizes[-1]} tokens in {B} sequences exceeds llama.cpp's batch of {n_batch}")
        self._context(B, C, sizes[-1] + 1)
        text = self.text

        def once(n: int) -> float:
            self._back_to_context(B, C)
            entries = [(text[(s + i) % len(text)], C + i, s, True) for s in range(B) for i in range(n)]
            t0 = time.perf_counter()
            self._decode(entries)
            for i in range(len(entries)):
                self._argmax(i)
            return time.perf_counter() - t0

        times = {n: [] for n in sizes}
        for r in range(reps + 2):
            for n in sizes:
                t = once(n)
                if r >= 2:
                    times[n].append(t)
        self._back_to_context(B, C)
        return {"ms": {str(n): 1e3 * sorted(t)[len(t) // 2] for n, t in times.items()}}

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            return self.hello()
        if op == "load":
            return self.load(req["path"], int(req["threads"]))
        if op == "decode":
            return self.decode(int(req["bucket"]), int(req["context"]), int(req["tokens"]), list(req.get("first", [])))
        if op == "window":
            return self.window(int(req["bucket"]), int(req["context"]), list(req["lengths"]), int(req.get("reps", 7)))
        raise ValueError(f"unknown request {op!r}")


def main():
    channel = os.fdopen(os.dup(1), "w")  # the protocol's; anything else written to fd 1 goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _load_protocol().serve(LlamaCpp().handle, sys.stdin, channel)


if __name__ == "__main__":
    main()
