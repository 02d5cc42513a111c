#!/usr/bin/env bash
# Compiled decode against stock mlx-lm on MLX's GPU backend (CUDA here), on random-weight
# models of real shapes (the GPU machine fetches nothing: the weights are made there).
#
#   benchmarks/gpu_bench.sh TOKENIZER_DIR OUT_DIR [SHAPES] [BUCKETS]
#
# TOKENIZER_DIR: a tokenizer folder (benchmarks/make_mlx_lm_model.py writes SmolLM2's).
# SHAPES: comma-separated shape[:bits] (default smollm2-135m,smollm2-135m:4,llama-3.2-1b,llama-3.2-1b:4);
# no bits = bfloat16. Each model's bench writes OUT_DIR/<shape>-<format>.json and .txt as it ends, so a
# run cut short keeps what it finished. Needs mlx with a GPU backend (pip install "mlx[cuda13]") and
# mlx-lm in the Python on PATH (or $PYTHON). GPU_BENCH_ANY_DEVICE=1 runs it on the CPU too (a dry run).
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
shapes=${3:-smollm2-135m,smollm2-135m:4,llama-3.2-1b,llama-3.2-1b:4}
buckets=${4:-1,2,4,8,16,32}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
export MLX_TRACER_BLAS=0 MLX_TRACER_MALLOC=0 PYTHONUNBUFFERED=1  # CPU-only pieces: nothing to bind on a GPU
mkdir -p "$out"
"$py" - <<'EOF' || { echo "gpu_bench: MLX has no GPU device here" >&2; exit 2; }
import mlx.core as mx
import os
assert os.environ.get("GPU_BENCH_ANY_DEVICE") or mx.default_device() == mx.gpu, mx.default_device()
x = mx.random.normal((4096, 4096)); mx.eval(x @ x)
print("mlx", mx.__version__, mx.default_device(), getattr(mx, "cuda", None) and mx.cuda.is_available() and "cuda")
EOF
for spec in ${shapes//,/ }; do
  shape=${spec%%:*}; bits=${spec#*:}; [ "$bits" = "$spec" ] && bits=
  fmt=${bits:+q$bits}; fmt=${fmt:-bf16}
  dir=/tmp/gpu-bench-models/$shape-$fmt
  [ -d "$dir" ] || "$py" "$here/make_random_mlx_model.py" --shape "$shape" --tokenizer "$tok" --out "$dir" ${bits:+--bits $bits} \
    || { echo "gpu_bench: could not write $dir" >&2; continue; }
  "$py" -m mlx_tracer bench --models smollm2 --model "$dir" --buckets "$buckets" --contexts 128,1024 \
    --tokens 64 --runs 3 --steady-steps 0 --no-baseline --no-peer --weights as-is \
    --json "$out/$shape-$fmt.json" 2>&1 | tee "$out/$shape-$fmt.txt"
done
