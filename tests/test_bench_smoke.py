"""Seconds-long smoke runs of the benchmark harness, so it cannot rot.
Speed itself is measured by `mlx-tracer bench` and benchmarks/, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from mlx_tracer import bench
from mlx_tracer.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_steady_state_adds_no_traces():
    r = bench.steady_state(steps=300, window=32, hidden=32, probe=40)
    # decode + the prompt's prefill window traced once before step 40; the ring
    # then wraps 9 times without another trace
    assert r["traces_at_early"] == r["traces_at_end"] == 2
    assert r["tps_early"] > 0 and r["tps_late"] > 0


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main([
        "bench", "--models", "llama-h32", "--buckets", "1,2", "--contexts", "16", "--tokens", "3", "--runs", "1",
        "--steady-steps", "60", "--json", str(out_json), "--plot", str(out_png),
    ])
    assert rc == 0
    table = capsys.readouterr().out
    assert "as-run" in table and "tracer" in table and "llama 4x32" in table and "steady state" in table
    data = json.loads(out_json.read_text())
    assert [r["bucket"] for r in data["rows"]] == [1, 2]
    assert all(r["stock_tps"] > 0 and r["tracer_tps"] > 0 and r["baseline_tps"] > 0 and r["traces"] == 1 for r in data["rows"])
    assert data["steady_state"]["step_early"] < data["steady_state"]["step_late"] == 60
    assert out_png.stat().st_size > 1000
    cond = data["meta"]["conditions"]
    assert "load average (1 min)" in table and cond["cores"] >= 1 and cond["load_after"] is not None
    assert ("WARNING" in table) == (not cond["quiet"])


def test_conditions_line_says_what_it_knows_and_warns_when_not_quiet():
    start = bench.Conditions(cores=2, busy=0, load_before=0.2)
    assert start.line() == "load average (1 min): 0.20 before, 2 cores"  # no after yet
    start.load_after = 1.6
    assert start.quiet and start.line() == "load average (1 min): 0.20 before, 1.60 after, 2 cores"
    loaded = bench.Conditions(cores=2, busy=0, load_before=1.2, load_after=1.9)
    assert not loaded.quiet and "WARNING: the machine was not quiet" in loaded.line()
    busy = bench.Conditions(cores=2, busy=2, load_before=0.1, load_after=3.0)
    assert not busy.quiet and "2 busy processes started" in busy.line() and "WARNING" not in busy.line()


def test_bench_model_names_are_checked_before_anything_runs(capsys):
    import pytest

    assert bench.parse_bench_model("qwen3-h256") == ("qwen3", 256) and bench.parse_bench_model("smollm2") == ("smollm2", None)
    for bad in ("llama-h100", "llama-hx", "gemma-h64", "llama"):
        with pytest.raises(ValueError, match="unknown bench model"):
            bench.parse_bench_model(bad)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--models", "llama-h64,llama-h7", "--json", "/nonexistent/never-written.json"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown bench model 'llama-h7'" in err and "multiple of 64" in err


def test_bench_runs_a_random_qwen3(capsys):
    model = bench.random_model("qwen3", 64)
    assert model.args.model_type == "qwen3" and hasattr(model.layers[0].self_attn, "q_norm")
    assert not mx.array_equal(model.layers[0].self_attn.q_norm.weight, mx.ones_like(model.layers[0].self_attn.q_norm.weight))
    rc = main(["bench", "--models", "qwen3-h64", "--buckets", "1", "--contexts", "16", "--tokens", "2", "--runs", "1",
               "--steady-steps", "0", "--no-baseline"])
    assert rc == 0 and "qwen3 4x64 fp32 (random)" in capsys.readouterr().out


def test_baseline_worker_decodes_on_request_reports_errors_and_exits():
    """The as-run baseline process: one run per request, on MLX's reference
    BLAS; a failed request raises in the parent with the worker's reason,
    and the worker goes on; closing it ends the process."""
    import pytest

    with bench.BaselineWorker() as worker:
        with pytest.raises(RuntimeError, match="baseline failed"):
            worker.decode(1, 16, 2)  # no model loaded yet
        with pytest.raises(RuntimeError, match="unknown bench model"):
            worker.load("no-such-model")
        worker.load("llama-h32")
        assert worker.decode(1, 16, 3) > 0 and worker.decode(2, 16, 3) > 0
        proc = worker._proc
    assert proc.poll() is not None  # ended with the with-block


def test_bench_busy_scenario_starts_and_stops_its_neighbours(tmp_path, capsys):
    rc = main(["bench", "--models", "llama-h32", "--buckets", "1", "--contexts", "16", "--tokens", "2", "--runs", "1",
               "--steady-steps", "0", "--no-baseline", "--busy", "1"])
    assert rc == 0
    assert "1 busy processes started beside the run on purpose" in capsys.readouterr().out
    with bench.busy_processes(2) as hogs:
        assert all(h.poll() is None for h in hogs)
    assert all(h.poll() is not None for h in hogs)


def test_pytest_benchmark_suite_runs_in_smoke_mode():
    env = dict(os.environ, BENCH_SMOKE="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-q", "--benchmark-disable", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "4 passed" in r.stdout


def test_the_roofline_divides_by_the_cores_peak_not_one_gemms_rate():
    """A ceiling is physical: FLOPs over the cores' peak from their ISA and
    clock, which no kernel can beat (one GEMM's measured rate could be, and a
    row read 123 %)."""
    from types import SimpleNamespace

    from mlx_tracer.bench.machine import Machine, peak_gflops, roofline_tps

    peak = peak_gflops()
    assert peak >= 8  # at least one core issuing 8 FLOPs a cycle at 1 GHz
    layouts = [SimpleNamespace(window=None, kv_heads=1, k_dim=8, v_dim=8)]
    costs = {"weight_bytes": 1e3, "params": 1e9, "kv_bytes_per_pos": 64}  # FLOP-bound: 2 GFLOP a token
    slow, fast = Machine({1 << 20: 100.0}, 10.0, 10.0), Machine({1 << 20: 100.0}, 10.0, 1000.0)
    assert roofline_tps(costs, layouts, fast, 8, 128) > 50 * roofline_tps(costs, layouts, slow, 8, 128)
