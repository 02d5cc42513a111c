"""Benchmark: stock mlx-lm decode against mlx-tracer's compiled loop.

For each model, batch-width bucket ``B`` and context ``C`` the harness gives
every row a context of ``C`` positions (:mod:`.models`), then decodes
``tokens`` tokens with stock mlx-lm and with mlx-tracer's ``Engine``
(:mod:`.systems`), in the same process, runs interleaved, the median of
``runs`` runs after a warm-up run of each (:mod:`.run`). The roofline is this
machine's (:mod:`.machine`); :mod:`.baseline` times stock mlx-lm as a user runs
it (reference BLAS) in a subprocess, a run at a time between the row's own;
:mod:`.peer` times llama.cpp on the same GGUF file the same way (an optional
column, where a Python with ``llama_cpp`` is found); both workers speak
:mod:`.protocol`. :mod:`.report` writes the table, JSON and plot;
:mod:`.speculative` times speculative decoding against plain decode (``--spec``).
``mlx-tracer bench`` runs it all.

Only ``mlx_tracer.cli`` imports this package (an import contract): nothing
the library needs lives here.
"""

from .baseline import BaselineWorker, worker_main
from .conditions import Conditions, busy_processes
from .machine import Machine, model_costs, roofline_tps
from .peer import PeerWorker, gguf_file, peer_threads, start_peer
from .protocol import WorkerError
from .models import DEFAULT_MODELS, copy_caches, load_bench_model, parse_bench_model, random_llama, random_model, synthetic_context
from .report import HEADER, PEAK_MEMORY, UNITS, format_row, plot, write_json
from .run import BenchRow, bench_model, steady_state
from .speculative import SPEC_HEADER, SpecRow, SpeculationChangedTokens, format_spec_row, spec_rows
from .systems import host_ms, run_peak, stock_decode, stock_host_ms, tracer_decode, tracer_host_ms

__all__ = [
    "BaselineWorker", "BenchRow", "Conditions", "DEFAULT_MODELS", "busy_processes", "HEADER", "Machine", "UNITS", "bench_model",
    "copy_caches", "format_row", "load_bench_model", "model_costs", "plot", "parse_bench_model", "random_llama", "random_model", "roofline_tps",
    "host_ms", "steady_state", "SPEC_HEADER", "SpecRow", "SpeculationChangedTokens", "format_spec_row", "spec_rows", "PeerWorker", "gguf_file", "peer_threads", "start_peer", "WorkerError", "PEAK_MEMORY", "run_peak", "stock_decode", "stock_host_ms", "synthetic_context", "tracer_decode", "tracer_host_ms", "worker_main", "write_json",
]
