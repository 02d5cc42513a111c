"""``python -m mlx_tracer.bench --worker``: the as-run baseline worker that
``mlx-tracer bench`` keeps (see :mod:`mlx_tracer.bench.baseline`)."""

import sys

from .baseline import worker_main

if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("usage: python -m mlx_tracer.bench --worker  (started by `mlx-tracer bench`; use that command)")
    worker_main()
