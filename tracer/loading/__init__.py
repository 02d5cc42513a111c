"""Model loading: files, formats, the cache folder's model store.

* :mod:`.store`: where the default model lives and how it is fetched;
* :mod:`.gguf` and :mod:`.tokenizer`: a llama GGUF file as mlx-lm's model and
  tokenizer;
* :mod:`.quant`, :mod:`.weights`, :mod:`.format_cache`: weight formats, the
  ``auto`` policy and its measured choices;
* :mod:`.load`: :func:`load_model`, all of the above in order.

Importing this package is cheap (no mlx): :mod:`.load` imports the rest on use.
"""

from .load import load_gguf, load_model

__all__ = ["load_gguf", "load_model"]
