"""Trace adapters: cache-like objects an unmodified mlx-lm model accepts inside mx.compile."""
