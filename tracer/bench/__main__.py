"""``python -m mlx_tracer.bench --worker``: the as-run baseline worker that
``mlx-tracer bench`` keeps (see :mod:`mlx_tracer.bench.baseline`);
``python -m mlx_tracer.bench '<spec JSON>'`` times a whole spec at once."""

import json
import sys

from .baseline import baseline_main, worker_main

if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    else:
        baseline_main(json.loads(sys.argv[1]))
