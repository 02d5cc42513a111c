"""Write an mlx-lm model folder with random weights of a real model's shape, for
timing where no weights can be fetched (the GPU machine has no internet).

    python benchmarks/make_random_mlx_model.py --shape smollm2-135m --tokenizer DIR --out DIR [--bits 4]

``--tokenizer``: a folder holding a tokenizer (``tokenizer.json`` and friends; e.g.
the one ``benchmarks/make_mlx_lm_model.py`` writes from SmolLM2's GGUF); its files are
copied beside the weights so that ``mlx_lm.load`` and ``mlx-tracer`` load the folder as
any other. The vocabulary is the tokenizer's (49,152 for SmolLM2's), whatever the shape's
own is: throughput depends on it only through the output head, and a generated id then
always decodes. ``--bits 4`` / ``8`` quantizes every linear layer and the embedding the way
mlx-lm's community models are (affine, ``--group-size`` 64); without it the weights are
``--dtype`` (bfloat16). Decode speed does not depend on the weights' values, only on
their shapes and format; the tokens they produce mean nothing.
"""
import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

SHAPES = {
    # hidden, layers, heads, kv heads, head dim, intermediate, tied embedding, rope theta
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, tie_word_embeddings=True, rope_theta=10000.0),
}


def vocab_of(tokenizer_dir: Path) -> int:
    """The tokenizer's vocabulary size, added tokens included."""
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = list(tj["model"]["vocab"].values()) + [t["id"] for t in tj.get("added_tokens", [])]
    return max(ids) + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json (copied)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=None, help="quantize (affine); default: float")
    ap.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not (a.tokenizer / "tokenizer.json").is_file():
        ap.error(f"{a.tokenizer} has no tokenizer.json: pass a tokenizer folder (make_mlx_lm_model.py writes one)")

    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "attention_bias": False, "mlp_bias": False,
              "vocab_size": vocab_of(a.tokenizer), **SHAPES[a.shape]}
    mx.random.seed(a.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, a.dtype))
    # nn.Linear's default init is uniform(±1/sqrt(in)); the embedding's is N(0, 1): scale it like a trained one
    model.model.embed_tokens.weight = 0.02 * model.model.embed_tokens.weight
    if a.bits:
        nn.quantize(model, group_size=a.group_size, bits=a.bits)
        config["quantization"] = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    mx.eval(model.parameters())
    a.out.mkdir(parents=True, exist_ok=True)
    save_model(a.out, model)
    config["torch_dtype"] = a.dtype
    save_config(config, config_path=a.out / "config.json")
    for f in a.tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) and f.is_file():
            shutil.copy(f, a.out / f.name)
    gb = sum(f.stat().st_size for f in a.out.glob("*.safetensors")) / 1e9
    print(f"wrote {a.out}: {a.shape}, vocab {config['vocab_size']}, "
          f"{f'{a.bits}-bit g{a.group_size}' if a.bits else a.dtype}, {gb:.3f} GB of weights")


if __name__ == "__main__":
    main()
