"""Write a GGUF file in another llama.cpp quantization type (Q4_K_M, Q6_K, ...)
with llama.cpp's own quantizer, so that k-quant files can be timed and
checked without downloading one.

    <llama-cpp-python's python> benchmarks/requantize_gguf.py SRC DST [--type Q4_K_M] [--threads 2]

Runs under a Python that has ``llama_cpp`` (llama-cpp-python; the bench's
``--peer-python``), not this project's venv. SRC may itself be quantized
(llama.cpp requantizes, as its ``llama-quantize --allow-requantize``): a
float16 file written by ``../shared/peers/make_random_gguf.py --qtype F16
--shape llama-3.2-1b`` gives a Llama-3.2-1B-shaped Q4_K_M file whose Q6_K
tensors (the output head, half the ``attn_v`` and ``ffn_down``) are what
llama.cpp would write for a real model. Rows whose length is not a multiple
of 256 (SmolLM2's 576) cannot hold k-quants; llama.cpp falls back to other
types for them (Q8_0 under ``Q6_K``; Q5_0, which MLX cannot read, under
``Q4_K_M``).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", default="Q4_K_M", choices=TYPES)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable here: run this under llama-cpp-python's python", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type}")
    params.nthread = args.threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama.cpp's quantizer failed (return code {rc})", file=sys.stderr)
        return 1
    print(f"wrote {args.dst} ({args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
