"""Static-shape batched KV caches (full and ring) and the per-forward mask builder."""
