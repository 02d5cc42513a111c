"""mlx-lm ``TokenizerWrapper`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Builds a byte-level BPE ``tokenizers.Tokenizer`` (vocabulary, merges, the
pre-tokenizer named by ``tokenizer.ggml.pre``, added and special tokens, the
BOS template), wraps it as a transformers fast tokenizer (for the chat
template) and then as mlx-lm's ``TokenizerWrapper`` with every stop token of
the file (eos, eot, eom).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .gguf import meta_value

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# tokenizer.ggml.pre values whose pre-tokenizer is "every digit alone, then
# GPT-2 byte level" (llama.cpp groups these together).
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}
_PRE_GPT2 = {"gpt2", "default", "gpt-2"}


def build_tokenizer(meta: dict, path="GGUF"):
    """mlx-lm ``TokenizerWrapper`` from ``tokenizer.ggml.*`` metadata."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers import pre_tokenizers as pre
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    kind = meta_value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer model {kind!r} is not supported; only byte-level "
            f"BPE ('gpt2') vocabularies are."
        )
    pre_kind = meta_value(meta, "tokenizer.ggml.pre", "default")
    # ByteLevel with use_regex applies GPT-2's split regex before mapping bytes.
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_kind in _PRE_DIGITS_GPT2:
        pre_tok = pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    elif pre_kind in _PRE_GPT2:
        pre_tok = byte_level
    else:
        raise ValueError(f"{path}: BPE pre-tokenizer {pre_kind!r} is not supported.")

    if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{path}: tokenizer.ggml.tokens/merges metadata is missing.")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = np.array(meta.get("tokenizer.ggml.token_type", mx.ones(len(tokens))))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.nonzero(types == _TOKEN_USER_DEFINED)[0]])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.nonzero(types == _TOKEN_CONTROL)[0]])

    def token(key):
        i = meta_value(meta, key)
        return None if i is None or i >= len(tokens) else tokens[int(i)]

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    if meta_value(meta, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = int(meta_value(meta, "tokenizer.ggml.bos_token_id"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=meta_value(meta, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    stop_ids = [int(meta_value(meta, k)) for k in
                ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                 "tokenizer.ggml.eom_token_id") if meta_value(meta, k) is not None]
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=stop_ids)
