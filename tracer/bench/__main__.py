"""``python -m mlx_tracer.bench '<spec JSON>'``: the as-run baseline worker
(see :mod:`mlx_tracer.bench.baseline`), started by ``mlx-tracer bench``."""

import json
import sys

from .baseline import baseline_main

if __name__ == "__main__":
    baseline_main(json.loads(sys.argv[1]))
