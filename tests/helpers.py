"""Helpers shared by the test modules."""

from __future__ import annotations

from mlx_tracer.runtime.engine import Engine


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
