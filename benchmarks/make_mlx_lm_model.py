"""Write an mlx-lm model folder (config.json, model.safetensors, tokenizer files)
from a llama GGUF, offline, keeping the weights quantized as the file holds them.

    python benchmarks/make_mlx_lm_model.py [--gguf FILE] [--out DIR] [--check] [--bits B [--group G]]

The GGUF is read by mlx-tracer's own loader (``mlx_tracer.loading.load.load_gguf``:
mx.load of the file, tensors renamed to mlx-lm llama names, q/k rows un-permuted,
layers quantized with the bits / group size of the packed triples; Q4_1 comes out
as MLX 4-bit affine, group 32). The weights are saved with mlx-lm's ``save_model``,
the config with ``save_config`` (a ``quantization`` entry naming every layer's
bits / group size, so mlx-lm rebuilds exactly these layers) and the tokenizer
mlx-tracer builds from the file's ``tokenizer.ggml.*`` metadata (a transformers
fast tokenizer carrying the file's chat template) with ``save_pretrained``.
``--check`` loads the folder back with ``mlx_lm.load`` and compares one greedy
forward pass with the GGUF-loaded model. ``--bits B`` writes the model as
``mlx_lm.convert -q --q-bits B --q-group-size G`` would from a bfloat16
checkpoint instead (:func:`requantize`: the file's weights dequantized to
bfloat16, then ``nn.quantize``): MLX's 2/3/5/6-bit models for
``benchmarks/mlx_bits.py`` and the README's 0.5.31 figures (for timing:
requantizing a 4-bit file's bfloat16 values costs it accuracy; mlx-lm's
own greedy text on it differs from the GGUF's).
"""
import argparse
import dataclasses
import os
from pathlib import Path

import mlx_tracer  # noqa: F401  (before mlx: mlx-tracer's BLAS, as its own loader expects)
import mlx.core as mx
import mlx.nn as nn

DEFAULT_GGUF = Path.home() / ".cache/mlx-tracer/SmolLM2-135M-Instruct.Q4_1.gguf"


def requantize(model, bits: int, group: int = 64, dtype=mx.bfloat16):
    """``model`` (in place) dequantized to ``dtype``, then quantized by
    ``nn.quantize`` at ``bits`` / ``group``: what mlx-lm's convert writes from
    a ``dtype`` checkpoint (scales and biases in ``dtype``). Returns it."""
    from mlx_tracer.loading.quant import dequantize_model

    dequantize_model(model, dtype)
    nn.quantize(model, group_size=group, bits=bits)
    mx.eval(model.parameters())
    return model


def layer_quantization(model) -> dict:
    """{"group_size", "bits", "mode"} of the first quantized layer, plus one
    entry per layer path: its own parameters, or False for a float layer."""
    per, first = {}, None
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            q = {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
            per[path] = q
            first = first or q
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            per[path] = False
    if first is None:
        return {}
    return {**first, **per}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--out", type=Path, default=Path("/tmp/smollm2-mlx"))
    ap.add_argument("--check", action="store_true", help="load the folder back with mlx_lm.load and compare logits")
    ap.add_argument("--bits", type=int, default=None, help="requantize as mlx-lm's convert would (2, 3, 4, 5, 6, 8)")
    ap.add_argument("--group", type=int, default=64, help="the group size of --bits")
    a = ap.parse_args()

    from mlx_lm.utils import save_config, save_model
    from mlx_tracer.loading.gguf import meta_value, model_args_from_metadata, read_gguf
    from mlx_tracer.loading.load import load_gguf

    model, tok = load_gguf(a.gguf)
    weights, meta = read_gguf(a.gguf)
    args = model_args_from_metadata(meta, weights, a.gguf)
    del weights
    if a.bits is not None:
        requantize(model, a.bits, a.group)

    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config["architectures"] = ["LlamaForCausalLM"]
    stop_ids = [int(meta_value(meta, k)) for k in
                ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                if meta_value(meta, k) is not None]
    config["eos_token_id"] = stop_ids[0] if len(stop_ids) == 1 else sorted(set(stop_ids))
    if meta_value(meta, "tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(meta_value(meta, "tokenizer.ggml.bos_token_id"))
    q = layer_quantization(model)
    if q:
        config["quantization"] = q

    a.out.mkdir(parents=True, exist_ok=True)
    save_model(a.out, model)
    save_config(config, a.out / "config.json")
    tok._tokenizer.save_pretrained(str(a.out))
    kinds = sorted({(v["bits"], v["group_size"], v["mode"]) for k, v in q.items() if isinstance(v, dict)})
    floats = sorted(k for k, v in q.items() if v is False)
    print(f"wrote {a.out}: {sorted(os.listdir(a.out))}")
    print(f"quantized layers (bits, group, mode): {kinds}; float layers: {floats or 'none'}")

    if a.check:
        from mlx_lm import load as mlx_lm_load

        m2, t2 = mlx_lm_load(str(a.out))
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        ids = t2.apply_chat_template(msgs, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids_ref = tok.apply_chat_template(msgs, add_generation_prompt=True)
        if isinstance(ids_ref, dict) or hasattr(ids_ref, "input_ids"):
            ids_ref = ids_ref["input_ids"]
        assert list(ids) == list(ids_ref), "chat template / tokenizer differ after the round trip"
        x = mx.array([list(ids)])
        l1, l2 = model(x)[0, -1], m2(x)[0, -1]
        diff = mx.abs(l1 - l2).max().item()
        print(f"prompt {len(ids)} tokens via the saved chat template; eos ids {sorted(t2.eos_token_ids)}; "
              f"max |logit diff| vs GGUF load {diff:.3g}; argmax {mx.argmax(l1).item()} / {mx.argmax(l2).item()}")
        from mlx_lm import generate
        print("greedy:", repr(generate(m2, t2, t2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                                       max_tokens=12, verbose=False)))


if __name__ == "__main__":
    main()
