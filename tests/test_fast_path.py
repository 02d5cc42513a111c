"""The CPU fast path: a fast BLAS activated before mlx, and the weight-format
policy. Each check runs in a fresh subprocess, since the BLAS binding is
decided when mlx is first imported."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest

from .helpers import CLI, FRANCE, SYSTEM, model_present


def fast_env(**extra):
    env = dict(os.environ)
    env.pop("MLX_TRACER_BLAS", None)  # the suite pins the reference BLAS; these runs do not
    env.update(extra)
    return env


def python(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=fast_env(**env))


STATUS = "from mlx_tracer.backend import blas; s = blas.status(); print('FAST' if s.fast else 'REFERENCE', s.library)"


def test_importing_mlx_first_warns_and_reports_the_reference_blas():
    r = python("import mlx.core\nimport mlx_tracer\n" + STATUS)
    assert r.returncode == 0, r.stderr
    assert "fast BLAS is NOT active" in r.stderr
    assert r.stdout.startswith("REFERENCE") and "libblas" in r.stdout


def test_importing_mlx_tracer_first_binds_mlx_to_the_fast_blas():
    r = python("import mlx_tracer\nimport mlx.core\n" + STATUS)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAST") and "blas-shim" in r.stdout


def test_the_cli_reports_the_fast_blas_and_the_switch_turns_it_off():
    r = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=300, env=fast_env())
    assert r.returncode == 0, r.stderr
    assert "OpenBLAS (scipy-openblas32)" in r.stdout and "blas-shim" in r.stdout
    r = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=300, env=fast_env(MLX_TRACER_BLAS="0"))
    assert r.returncode == 0 and "reference BLAS" in r.stdout and "libblas" in r.stdout


def test_weight_formats_convert_exactly(tmp_path):
    """float32 weights equal mx.dequantize of the triples in fp32; float32-blocks keeps the head quantized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_tracer.loading.weights import apply_format

    from .tiny_models import tiny_model

    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    q = dict(tree_flatten(model.parameters()))
    want = {
        k[: -len(".scales")]: mx.dequantize(
            q[k[: -len("scales")] + "weight"], q[k].astype(mx.float32), q[k[: -len("scales")] + "biases"].astype(mx.float32),
            group_size=32, bits=4,
        )
        for k in q if k.endswith(".scales")
    }
    blocks = apply_format(tiny_model_quantized(), "float32-blocks")
    f32 = apply_format(model, "float32")
    got = dict(tree_flatten(f32.parameters()))
    for name, w in want.items():
        assert got[name + ".weight"].dtype == mx.float32 and mx.array_equal(got[name + ".weight"], w), name
    kinds = {n: type(m).__name__ for n, m in blocks.named_modules()}
    assert kinds["model.layers.0.self_attn.q_proj"] == "Linear"
    assert kinds["lm_head"] == "QuantizedLinear" and kinds["model.embed_tokens"] == "QuantizedEmbedding"


def tiny_model_quantized():
    import mlx.nn as nn

    from .tiny_models import tiny_model

    m = tiny_model("llama")
    nn.quantize(m, group_size=32, bits=4)
    mx.eval(m.parameters())
    return m


AUTO_SCRIPT = f"""
import json, mlx_tracer
import mlx.core as mx
from mlx_tracer import Generator
from mlx_tracer.backend import blas, kernels
assert blas.status().fast, blas.status()
system = {SYSTEM!r}
ref = Generator.load(weights="as-is", system=system)
auto = Generator.load(weights="auto", system=system)
texts = [{FRANCE!r}, "Name three colors.", "Write a haiku about the sea.", "Hi"]
prompt = ref.encode(texts[0])
l_ref = ref.model(mx.array([prompt]))[:, -1, :]
l_auto = auto.model(mx.array([prompt]))[:, -1, :]
a = [o.tokens for o in ref.batch_generate(texts[:1], max_tokens=24)] + [o.tokens for o in ref.batch_generate(texts, max_tokens=12)]
b = [o.tokens for o in auto.batch_generate(texts[:1], max_tokens=24)] + [o.tokens for o in auto.batch_generate(texts, max_tokens=12)]
from mlx_tracer.loading import format_cache, store
from mlx_tracer.loading.weights import pick_format
choice = format_cache.find(format_cache.Setup.of(store.resolve_model()))
from mlx_tracer.loading.weights import quantized_candidates
print(json.dumps({{"format": auto.weights, "same": a == b, "maxdiff": mx.abs(l_ref - l_auto).max().item(),
                  "france": auto.tokenizer.decode(b[0]), "recorded": choice.format,
                  "timed": sorted(choice.timings), "rule": pick_format(choice.timings),
                  "candidates": list(quantized_candidates()), "isa": kernels.load().qmm_isa()}}))
"""


@pytest.mark.model
@pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")
def test_auto_weights_with_the_fast_blas_keep_the_greedy_tokens():
    import json

    r = python(AUTO_SCRIPT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # which format wins depends on the machine; that it follows the recorded
    # timings by the documented rule (tracer/loading/weights.py) does not
    assert out["format"] == out["recorded"] == out["rule"], out
    # sorted; the quantized formats: the kernels are built (the factored contract where they run on AVX2, and split)
    want = ["quantized-factored" if out["isa"] == "avx2" else "quantized", "quantized-split"]
    assert out["candidates"] == want and out["timed"] == sorted(["as-is", "float32", *want]), out
    assert out["same"], out
    assert "Paris" in out["france"]
    assert out["maxdiff"] < 1e-2, out
    print("max |logit difference| at the first step:", out["maxdiff"])
