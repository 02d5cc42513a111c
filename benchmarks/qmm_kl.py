"""How far qmm's *fast* (or *factored*) contract moves SmolLM2-135M's
next-token distributions from the *exact* contract's: the KL divergence
KL(exact || other) at each position of a text of --tokens tokens.

    python benchmarks/qmm_kl.py [--tokens 2048] [--seed 0] [--formats quantized quantized-fast]

Two Generators load the default model (SmolLM2-135M-Instruct Q4_1) in the
two weight formats of --formats: by default ``quantized`` (the layer kernels
and the head on qmm's exact contract) and ``quantized-fast`` (the same on its
fast contract); ``quantized-factored`` (the factored contract) or ``as-is``
(MLX's own quantized matmuls, mlx-lm's arithmetic; ~0.15 s a step here) also
serve, on either side.
Both run the same tokens in lockstep
through their compiled steps at bucket 1: a window step over a fixed prompt,
then one decode step per token (``return_logits=True``), teacher-forced. The
text is drawn from the exact model's own distribution (temperature 1, a numpy
generator seeded with --seed), so it is fixed for a seed and typical of the
model rather than a loop of greedy repeats; each position's KL is computed in
float64 from the two float32 logit rows. Prints the mean, median, p99 and max
KL, and how often the two argmax tokens differ.

``--q6-k REF OTHER`` instead compares two ways of loading a file's Q6_K
tensors (``MLX_TRACER_Q6_K``: ``float16``, MLX's cast, ``int8``, the
8-bit blocks of :func:`mlx_tracer.loading.gguf_readonly.q6_k_affine`, or
``int6``, its integers below 64, held as 6-bit blocks), both
sides in the first of --formats; ``--model`` names the GGUF file (one with
Q6_K tensors: SmolLM2 requantized by llama.cpp's ``Q6_K`` type, say).
"""

from __future__ import annotations

import argparse
import os
import time

import mlx_tracer  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
import numpy as np
from mlx_tracer import Generator
from mlx_tracer.backend import kernels

PROMPT = ("The history of the lighthouse is a history of people trying to make the sea a little less dangerous. "
          "Long before electric lamps, keepers tended fires of wood and coal on towers by the shore, and")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="positions scored (after the prompt)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs=2, default=["quantized", "quantized-fast"], metavar=("REFERENCE", "OTHER"),
                    help="the two weight formats compared (KL(reference || other))")
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--q6-k", nargs=2, default=None, metavar=("REFERENCE", "OTHER"), choices=("float16", "int8", "int6"),
                    help="compare the file's Q6_K tensors loaded these two ways ($MLX_TRACER_Q6_K)")
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"the native kernels are off: {kernels.status()}")
    if args.q6_k:
        names, loaded = [f"{args.formats[0]}, Q6_K {q}" for q in args.q6_k], []
        for q in args.q6_k:
            os.environ["MLX_TRACER_Q6_K"] = q
            loaded.append(Generator.load(args.model, weights=args.formats[0]))
        ref, other = loaded
    else:
        names = args.formats
        ref, other = (Generator.load(args.model, weights=f) for f in names)
    for name, gen in zip(names, (ref, other)):
        lean = gen.engine.compiled.lean
        if not name.startswith("as-is") and (lean.binding is None or lean.native_off is not None):
            raise SystemExit(f"{name} does not run on the kernels here (kernels: {lean.native_off})")
    prompt = ref.tokenizer.encode(PROMPT)
    cap = len(prompt) + args.tokens + 1
    steps = [(g.engine.compiled, g.engine.compiled.new_caches(1, rows=1, capacity=cap)) for g in (ref, other)]
    print(f"qmm {K.qmm_isa()}, {K.qmm_threads()} threads; {names[0]} against {names[1]}; "
          f"prompt {len(prompt)} tokens, {args.tokens} scored; load average {os.getloadavg()[0]:.2f}")
    logits = [cm.step(c, mx.array([prompt]), return_logits=True).logits for cm, c in steps]
    rng = np.random.default_rng(args.seed)
    kl, differ, t0 = [], 0, time.perf_counter()
    for i in range(args.tokens):
        p, q = (log_softmax(np.array(l[0], np.float32)) for l in logits)
        kl.append(float((np.exp(p) * (p - q)).sum()))
        differ += int(p.argmax() != q.argmax())
        tok = int(rng.choice(p.size, p=np.exp(p) / np.exp(p).sum()))
        logits = [cm.step(c, mx.array([[tok]]), return_logits=True).logits for cm, c in steps]
    kl = np.array(kl)
    print(f"KL({names[0]} || {names[1]}) over {kl.size} positions: mean {kl.mean():.3e}, median {np.median(kl):.3e}, "
          f"p99 {np.quantile(kl, 0.99):.3e}, max {kl.max():.3e} (nats); argmax differs at {differ} "
          f"({100 * differ / kl.size:.2f}%); {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
