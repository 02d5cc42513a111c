"""Weight formats chosen for the backend, at load time.

Formats: ``as-is`` (as loaded: a GGUF's 4/8-bit blocks stay quantized),
``quantized`` (the quantized linears' blocks as loaded, everything else
float32, so the activations are float32: with the native kernels the lean
forward's matmuls read the blocks themselves, :mod:`mlx_tracer.backend.kernels`,
in their *exact* contract: each weight ``scale * q + bias`` in float32),
``quantized-factored`` (the same, in the kernels' *factored* contract: per
group, ``scale * sum(q * x) + bias * sum(x)`` in float32, the arithmetic of
MLX's Metal kernels; about half the float work per weight at one or two
rows of x), ``quantized-fast`` (the same, with the kernels' *fast* arithmetic:
activations quantized to int8 per block of 32 and integer dot products, as
llama.cpp computes; faster where the matmuls are compute-bound, not equal
to mlx-lm's values: the KL of its next-token distributions is measured by
``benchmarks/qmm_kl.py``; ``auto`` never picks it), ``quantized-split``
(the fast arithmetic on activations in 15 bits: each block of 32 as an
int8 part and an int8 remainder at 1/128 of its scale, the integer products
of both joined exactly; within a mean KL of 2.1e-7 nats of the exact
contract on SmolLM2), ``float32`` (every
quantized layer dequantized, scales and biases cast to fp32 first),
``float32-blocks`` (transformer blocks dequantized, the quantized
embedding/head kept). ``auto``:

* on a GPU backend: ``as-is``;
* on the CPU: ``as-is``, the quantized formats (where the native quantized
  matmul is built: ``quantized-factored`` where its kernels run on AVX2, the
  path where the factored sums are faster, ``quantized`` on AVX-512 and the
  portable path; and ``quantized-split``; :func:`quantized_candidates`) and
  ``float32`` (or ``float32-blocks`` when fp32 weights would
  take more than half of the available RAM) are each timed on compiled decode
  steps at batch 1 and 4 (the step the loop runs); the fastest of those that
  keep the file's blocks wins (``as-is`` on a tie), and a float32 format wins
  only if it beats that by more than 10% (it costs up to 4-6x the memory):
  :func:`pick_format` is that rule. The decision is cached per
  model file, MLX version, BLAS and core count in ``<cache dir>/formats.json``
  (:mod:`.format_cache`), so it is measured once, not guessed. With MLX's
  reference BLAS ``as-is`` wins (its fp32 GEMM is slow); with the fast BLAS
  ``float32`` does (MLX's CPU 4-bit matmul does not reuse weights across
  rows).

Re-measure rule. Timings taken while other work competes for the cores say
little about the formats (a busy 2-core machine here timed float32 13x
slower than a quiet one, and picked as-is). So each choice is stored with the
1-minute load average (``os.getloadavg``) of its measurement, the larger of
the values before and after timing. A choice measured while the load average
exceeded the core count (or with no load average known) is *provisional*:
it is used as long as the machine is still that busy, and measured again,
replacing it, at the first ``auto`` load that finds the load average at or
below the core count. A choice measured at or below the core count stands
until its setup changes (model file, MLX, BLAS, cores).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from . import format_cache
from .format_cache import FormatChoice, Setup, Timings
from ..adapters.lean.weights import CONTRACT_ATTR
from .quant import dequantize_model, float32_activations, float32_bytes, is_quantized

FORMATS = ("auto", "as-is", "quantized", "quantized-factored", "quantized-fast", "quantized-split", "float32",
           "float32-blocks")
# the formats that keep the file's quantized blocks (its memory)
BLOCKS = ("as-is", "quantized", "quantized-factored", "quantized-fast", "quantized-split")
CONTRACTS = {"quantized": "exact", "quantized-factored": "factored", "quantized-fast": "fast",
             "quantized-split": "split"}  # qmm's, per format
MARGIN = 1.1  # a larger format must be this much faster than as-is (ms per token)
BATCHES = (1, 4)  # batch widths timed per format


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return fmt


def apply_format(model, fmt: str):
    """Convert ``model`` in place to ``fmt`` (not ``auto``); returns it."""
    check_format(fmt)
    if fmt in CONTRACTS:
        float32_activations(model)
        setattr(model, CONTRACT_ATTR, CONTRACTS[fmt])
    elif fmt == "float32":
        dequantize_model(model, mx.float32)
    elif fmt == "float32-blocks":
        dequantize_model(model, mx.float32, select=lambda path: ".layers." in f".{path}")
    return model


def available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def decode_step_ms(model, B: int, context: int = 16, reps: int = 3) -> float:
    """Median ms of one compiled decode step (what the loop runs: the lean
    forward, the native kernels where they apply) at batch ``B`` over
    ``context`` tokens, after a first step that traces it."""
    from ..runtime.step import CompiledModel

    compiled = CompiledModel(model)
    caches = compiled.new_caches(B, rows=B)
    compiled.step(caches, mx.zeros((B, context), dtype=mx.int32))
    y = mx.zeros((B, 1), dtype=mx.int32)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        out = compiled.step(caches, y)
        mx.eval(out.tokens)
        if i:  # the first traced and built the step's kernels
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def quantized_kernels() -> bool:
    """Whether the native quantized matmul is built here (the ``quantized`` format's fast path)."""
    from ..backend import kernels

    return kernels.load() is not None and hasattr(kernels.load(), "qmm")


def quantized_candidates() -> tuple:
    """The quantized formats ``auto`` times, () without the kernels: the
    float contract of the path, ``quantized-factored`` where the native
    quantized matmul runs on AVX2 (its factored sums about half the float
    work per weight of the exact contract's dequantization there: a
    bucket-1 step's matmuls ~1.3x faster, 0.5.14's notes in the README),
    ``quantized`` on its other paths (AVX-512 looks each weight up in a
    table, as cheap as a factored sum); and ``quantized-split`` (integer
    products on x in 15 bits: as fast as the factored sums on SmolLM2,
    1.1x at bucket 1 and 1.6x at bucket 4 on Llama-3.2-1B's shape, 0.5.15's
    notes; its next-token distributions within a mean KL of 2.1e-7 nats of
    the exact contract's, closer than that is to mlx-lm's own CPU
    arithmetic, 6.2e-7)."""
    if not quantized_kernels():
        return ()
    from ..backend import kernels

    return ("quantized-factored" if kernels.load().qmm_isa() == "avx2" else "quantized", "quantized-split")


def ms_per_token(timings_of_one_format: dict) -> float:
    """Geometric mean over the timed batch widths of ms per token."""
    return statistics.geometric_mean([ms / b for b, ms in timings_of_one_format.items()])


def pick_format(timings: Timings) -> str:
    """The documented rule: of the formats that keep the file's blocks, the
    one with the fewest ms per token (``as-is`` on a tie); a float32 format
    instead if it beats that by more than :data:`MARGIN`."""
    score = {f: ms_per_token(t) for f, t in timings.items()}
    small = min((f for f in BLOCKS if f in score), key=lambda f: (score[f], f != "as-is"))
    large = [f for f in score if f not in BLOCKS]
    best = min(large, key=score.get) if large else small
    return best if score[best] * MARGIN <= score[small] else small


def current_load() -> Optional[float]:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def should_remeasure(known: FormatChoice, load_now: Optional[float]) -> bool:
    """The re-measure rule (module docstring): a choice timed on a busy
    machine is measured again once the machine is quiet."""
    return known.measured_busy and load_now is not None and load_now <= known.setup.cores


def choose_format(model, source: Optional[Path], reload, log=lambda s: None) -> tuple:
    """Resolve ``auto``: ``(model in the chosen format, format, timings)``.

    ``reload()`` gives a fresh as-loaded model (the float conversions are in place).
    """
    if mx.default_device() == mx.gpu or not is_quantized(model):
        return model, "as-is", {}
    setup = Setup.of(source) if source is not None else None
    known = format_cache.find(setup) if setup is not None else None
    load_before = current_load()
    avail = available_memory()
    fits = avail is None or float32_bytes(model) < avail // 2
    # fp32 everywhere when it fits; else blocks only (the head stays quantized)
    quantized = list(quantized_candidates())
    candidates = ["as-is"] + quantized + ["float32" if fits else "float32-blocks"]
    missing = [f for f in quantized if known is not None and f not in known.timings]
    if known is not None and not missing and not should_remeasure(known, load_before):
        fmt = known.format
        return (apply_format(model, fmt) if fmt != "as-is" else model), fmt, known.timings
    if missing:
        log(f"measuring weight formats again: the stored choice did not time {', '.join(missing)}")
    elif known is not None:
        log(f"measuring weight formats again: the stored choice was timed at load average {known.load_avg} "
            f"on {known.setup.cores} cores, now {load_before:.2f}")
    timings: Timings = {}
    for fmt in candidates:
        m = model if fmt == "as-is" else apply_format(reload(), fmt)
        log(f"timing weights format {fmt} ...")
        timings[fmt] = {B: decode_step_ms(m, B) for B in BATCHES}
        del m
    fmt = pick_format(timings)
    if setup is not None:
        loads = [x for x in (load_before, current_load()) if x is not None]
        format_cache.record(FormatChoice(setup, fmt, timings, max(loads) if loads else None, time.time()))
    return (model if fmt == "as-is" else apply_format(reload(), fmt)), fmt, timings
