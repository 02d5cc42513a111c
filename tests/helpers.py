"""Helpers shared by several test modules (test modules never import each other)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import json

from mlx_tracer.runtime.engine import Engine

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FRANCE = "What is the capital of France? Answer in one sentence."

# the console script of the environment running the tests
CLI = str(Path(sys.executable).parent / "mlx-tracer")


def model_present() -> bool:
    """Whether the SmolLM2 GGUF (or $MLX_TRACER_MODEL) is there and valid."""
    from mlx_tracer.loading.store import is_valid_model_file, resolve_model

    try:
        return is_valid_model_file(resolve_model())
    except FileNotFoundError:
        return False


class IdTokenizer:
    """A stand-in tokenizer for tiny models: token ids are their own text."""

    eos_token_ids = {0}
    has_chat_template = False
    bos_token = None

    class _Detok:
        """Like mlx-lm's streaming detokenizers: last_segment is the unread text."""

        def __init__(self):
            self.reset()

        def reset(self):
            self._unread = ""

        def add_token(self, t):
            self._unread += f"<{t}>"

        def finalize(self):
            pass

        @property
        def last_segment(self):
            out, self._unread = self._unread, ""
            return out

    detokenizer = _Detok()

    def encode(self, text, add_special_tokens=True):
        return [int(x) for x in text.split()]

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def solo_tokens(model, prompt, n):
    eng = Engine(model, buckets=(1,))
    eng.add(prompt, max_tokens=n)
    return [ev.token for ev in eng.run()]


def write_model_dir(model, cfg: dict, path):
    """``model`` saved as an mlx-lm model folder: its config, its weights, and a
    WordLevel tokenizer whose tokens are their ids."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tok_json = {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": {str(i): i for i in range(cfg["vocab_size"])}, "unk_token": "0"},
        "pre_tokenizer": {"type": "Whitespace"},
        "decoder": None,
        "added_tokens": [],
    }
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "0"}))
    return path


def save_model_dir(path, family: str = "llama", seed: int = 0):
    """A tiny random model of ``family`` saved as an mlx-lm model folder."""
    from .tiny_models import _config, tiny_model

    return write_model_dir(tiny_model(family, seed=seed), _config(family), path)


@contextlib.contextmanager
def forced_isa(kernels_module, name: str):
    """The native kernels' ISA path ``name`` forced for the block (skipped
    where this CPU lacks it); the path in use before restored after."""
    import pytest

    before = kernels_module.qmm_isa()
    try:
        if kernels_module.qmm_set_isa(name) != name:
            pytest.skip(f"this CPU has no {name}")
        yield name
    finally:
        kernels_module.qmm_set_isa(before)


def assert_decode_writes_in_place(cm, what: str = "the compiled step copied the K/V buffers"):
    """Three decode steps of ``cm`` on one fresh row: none may allocate a
    quarter of the caches' bytes (their buffers are written where they are)."""
    import mlx.core as mx

    caches = cm.new_caches(1, rows=1)
    out = cm.step(caches, mx.array([[1]]))
    mx.eval(out.tokens, [c.state for c in caches])
    total = sum(c.nbytes for c in caches)
    for t in range(3):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = cm.step(caches, mx.array([[t + 2]]))
        mx.eval(out.tokens, [c.state for c in caches])
        assert mx.get_peak_memory() - base < total // 4, what
