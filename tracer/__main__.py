"""``python -m mlx_tracer``: the ``mlx-tracer`` command."""

import sys

from .cli import main

sys.exit(main())
