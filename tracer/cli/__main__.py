"""``python -m mlx_tracer.cli``: the ``mlx-tracer`` command."""

import sys

from . import main

sys.exit(main())
