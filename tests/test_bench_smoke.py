"""Seconds-long smoke runs of the benchmark harness, so it cannot rot.
Speed itself is measured by `mlx-tracer bench` and benchmarks/, not here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_tracer import bench
from mlx_tracer.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_steady_state_adds_no_traces():
    r = bench.steady_state(steps=300, window=32, hidden=32, probe=40)
    # decode + the prompt's prefill window traced once before step 40; the ring
    # then wraps 9 times without another trace
    assert r["traces_at_early"] == r["traces_at_end"] == 2
    assert r["tps_early"] > 0 and r["tps_late"] > 0


def python_without_llama_cpp(tmp_path) -> Path:
    """A Python that cannot import llama_cpp, whatever this venv holds: this one without site-packages."""
    fake = tmp_path / "python-without-llama-cpp"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    fake.chmod(0o755)
    return fake


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main([
        "bench", "--models", "llama-h32", "--buckets", "1,2", "--contexts", "16", "--tokens", "3", "--runs", "1",
        "--steady-steps", "60", "--json", str(out_json), "--plot", str(out_png),
        "--peer-python", str(python_without_llama_cpp(tmp_path)),
    ])
    assert rc == 0
    table = capsys.readouterr().out
    assert "as-run" in table and "tracer" in table and "llama 4x32" in table and "steady state" in table
    # the llama.cpp column: skipped, with a one-line note in the table and the JSON
    skip = [line for line in table.splitlines() if line.startswith("llama.cpp: skipped")]
    assert len(skip) == 1 and "llama_cpp is not importable" in skip[0] and "--peer-python" in skip[0]
    data = json.loads(out_json.read_text())
    assert [r["bucket"] for r in data["rows"]] == [1, 2]
    assert all(r["stock_tps"] > 0 and r["tracer_tps"] > 0 and r["baseline_tps"] > 0 and r["traces"] == 1 for r in data["rows"])
    assert not data["meta"]["peer"]["ran"] and data["meta"]["peer"]["note"] == skip[0]
    assert all(r["peer_tps"] is None and r["peer_note"] == skip[0] for r in data["rows"])
    # peak memory per system, each measured apart, and how
    assert all(r["stock_peak_mb"] > 0 and r["peak_mb"] > 0 and r["baseline_peak_mb"] > 0 for r in data["rows"])
    assert {"stock_peak_mb", "peak_mb", "baseline_peak_mb", "peer_peak_mb"} <= set(data["meta"]["peak_memory"])
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


def test_no_stock_skips_the_stock_column_and_its_cells_read_a_dash(tmp_path, capsys, monkeypatch):
    import json

    from mlx_tracer.bench import systems

    calls = []
    monkeypatch.setattr(systems, "_stock_steps", lambda *a: calls.append(a))  # a stock step would fail loudly
    out_json = tmp_path / "rows.json"
    rc = main(["bench", "--models", "llama-h32", "--buckets", "1,2", "--contexts", "16", "--tokens", "2", "--runs", "1",
               "--steady-steps", "0", "--no-baseline", "--no-peer", "--no-stock", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0 and not calls
    rows = [line.split() for line in out.splitlines() if line.startswith("llama 4x32 fp32 (random)")]
    assert len(rows) == 2 and all(r[7] == "-" and float(r[8]) > 0 for r in rows), rows  # stock '-', tracer tok/s
    for r in json.loads(out_json.read_text())["rows"]:
        assert r["stock_tps"] is None and r["ratio"] is None and r["stock_peak_mb"] is None and r["tracer_tps"] > 0


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


def test_the_peer_is_skipped_with_a_note_when_its_python_cannot_run_it(tmp_path):
    worker, note = bench.start_peer(str(python_without_llama_cpp(tmp_path)))
    assert worker is None and note.startswith("llama.cpp: skipped") and "No module named 'llama_cpp'" in note
    worker, note = bench.start_peer(str(tmp_path / "no-such-python"))
    assert worker is None and note.startswith("llama.cpp: skipped (cannot run")
    assert bench.gguf_file("llama-h64", None) is None  # random models: no file for the peer


@pytest.mark.skipif(not os.environ.get("MLX_TRACER_TEST_PEER_PYTHON"),
                    reason="MLX_TRACER_TEST_PEER_PYTHON (a Python with llama_cpp) not set")
def test_the_peer_times_verify_windows_on_the_same_file():
    """llama.cpp's verify-window timings (benchmarks/spec_ceiling.py --peer-python): a decode call of L
    tokens a sequence for L = 1 and each length asked, after the same context, rolled back between calls."""
    worker, note = bench.start_peer(os.environ["MLX_TRACER_TEST_PEER_PYTHON"])
    assert worker is not None, note
    path = bench.gguf_file("smollm2", None)
    if path is None:
        pytest.skip("the default model is no GGUF file here")
    try:
        worker.load(path, 2)
        ms = worker.window(1, 64, [5, 17], reps=3)
        assert set(ms) == {1, 5, 17} and all(t > 0 for t in ms.values())
        assert ms[17] > ms[1]  # 17 tokens' products cost more than one's
        # two sequences; each call starts from the context (the worker checks every sequence went back to
        # its 64 positions, and llama_decode refuses positions that do not follow a sequence's last)
        again = worker.window(2, 64, [3], reps=1)
        assert set(again) == {1, 3} and all(t > 0 for t in again.values())
        with pytest.raises(bench.WorkerError, match="exceeds llama.cpp's batch"):
            worker.window(1, 64, [100000], reps=1)
    finally:
        worker.close()


def test_run_peak_counts_one_system_apart_from_what_else_is_live():
    """A system's peak is what it owns plus what its run allocated, not the
    other systems' arrays that happen to be live in the process."""
    other = mx.zeros((4 << 20,))  # 16 MB of another system's
    mx.eval(other)

    def run():
        a = mx.ones((1 << 20,))  # 4 MB
        mx.eval(a)
        return 7

    out, peak = bench.run_peak(run, owned_bytes=1e6)
    assert out == 7 and 5 <= peak < 9, peak


def _llama(tied: bool, fmt):
    """A 2-layer random llama (hidden 128) in a weight format: a dtype name or (bits, group size)."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           tie_word_embeddings=tied)
    model = llama.Model(args)
    if isinstance(fmt, str):
        model.set_dtype(getattr(mx, fmt))
    else:
        nn.quantize(model, group_size=fmt[1], bits=fmt[0])
    mx.eval(model.parameters())
    return model, args


FORMATS = ["float32", "float16", "bfloat16", (4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_roofline_counts_weights_as_stored_and_cannot_exceed_one(fmt, tied):
    """Per format: the bytes a step reads are the weights as stored (a 4-bit
    layer's blocks, scales and biases, never float32; an untied embedding
    table is not read), the FLOPs each matmul weight once; so a system doing
    the least work physically possible, at the machine's rates, reads at most
    100 % of the ceiling, whether bandwidth- or compute-bound, with float32
    arithmetic or int8 dot products on the quantized layers."""
    from types import SimpleNamespace

    from mlx_tracer.bench.machine import Machine, model_costs, roofline_tps

    model, a = _llama(tied, fmt)
    hd = a.hidden_size // a.num_attention_heads
    shapes = [(a.num_attention_heads * hd, a.hidden_size), (a.num_key_value_heads * hd, a.hidden_size),
              (a.num_key_value_heads * hd, a.hidden_size), (a.hidden_size, a.num_attention_heads * hd),
              (a.intermediate_size, a.hidden_size), (a.intermediate_size, a.hidden_size),
              (a.hidden_size, a.intermediate_size)] * a.num_hidden_layers + [(a.vocab_size, a.hidden_size)]  # the head
    itemsize = 4 if fmt == "float32" or not isinstance(fmt, str) else 2  # nn.quantize keeps float32 scales here

    def stored(out, inp):
        if isinstance(fmt, str):
            return out * inp * itemsize
        bits, group = fmt
        return out * inp * bits // 8 + 2 * out * (inp // group) * itemsize

    norms = (2 * a.num_hidden_layers + 1) * a.hidden_size * itemsize
    expected_bytes = sum(stored(o, i) for o, i in shapes) + norms
    params = sum(o * i for o, i in shapes)
    layouts = [SimpleNamespace(window=None, kv_heads=a.num_key_value_heads, k_dim=hd, v_dim=hd, dtype=mx.float32)
               for _ in range(a.num_hidden_layers)]
    costs = model_costs(model, layouts)
    assert costs["weight_bytes"] == expected_bytes
    assert costs["params"] == params
    assert costs["quantized_params"] == (0 if isinstance(fmt, str) else params)
    if not isinstance(fmt, str):  # the blocks, not their float32 expansion
        assert costs["weight_bytes"] < 0.45 * (4 * params + norms)

    for machine in (Machine({1 << 20: 20.0, 1 << 28: 10.0}, 30.0, 300.0),  # bandwidth-bound
                    Machine({1 << 20: 2000.0, 1 << 28: 1000.0}, 0.5, 1.0)):  # compute-bound
        for B in (1, 8):
            for C in (16, 1024):
                kv = B * C * a.num_hidden_layers * 2 * a.num_key_value_heads * hd * 4
                read = expected_bytes + kv
                attn = B * a.num_hidden_layers * 4 * C * a.num_attention_heads * hd
                fp32 = B * 2 * params + attn  # the exact contract: float32 arithmetic
                best = [read / (machine.bandwidth(read) * 1e9), fp32 / (machine.float_rate * 1e9)]
                if not isinstance(fmt, str):  # the fast contract: int8 dot products on the blocks
                    best[1] = min(best[1], B * 2 * params / (machine.int8_rate * 1e9) + attn / (machine.float_rate * 1e9))
                ideal_tps = B / max(best)
                assert ideal_tps <= roofline_tps(costs, layouts, machine, B, C) * (1 + 1e-9)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_the_roofline_counts_kv_bytes_of_every_float_dtype(dtype):
    """A bfloat16 model's caches (NumPy has no bfloat16: the count once
    failed on it, so the bench could not run a bfloat16 model) are 2 bytes a
    value, like float16's; float32's 4."""
    from types import SimpleNamespace

    from mlx_tracer.bench.machine import model_costs

    model, a = _llama(True, "float32")
    hd = a.hidden_size // a.num_attention_heads
    layouts = [SimpleNamespace(window=None, kv_heads=a.num_key_value_heads, k_dim=hd, v_dim=hd, dtype=dtype)
               for _ in range(a.num_hidden_layers)]
    per_pos = model_costs(model, layouts)["kv_bytes_per_pos"]
    assert per_pos == a.num_hidden_layers * a.num_key_value_heads * 2 * hd * (4 if dtype == mx.float32 else 2)


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


def test_bench_spec_table_per_bucket(tmp_path, capsys):
    """``--spec``: plain decode against prompt lookup on SmolLM2 per bucket,
    printed and in the JSON (speedup, acceptance, tokens per verify step,
    verify/decode step cost per window); the two systems' greedy tokens are
    compared inside (a difference raises)."""
    from .helpers import model_present

    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    out_json = tmp_path / "s.json"
    rc = main(["bench", "--models", "llama-h32", "--buckets", "1,2", "--contexts", "16", "--tokens", "12", "--runs", "1",
               "--steady-steps", "0", "--no-baseline", "--no-peer", "--weights", "quantized", "--spec",
               "--spec-draft-tokens", "3", "--json", str(out_json)])
    assert rc == 0
    table = capsys.readouterr().out
    assert bench.SPEC_HEADER in table and "quotes its prompt" in table and "free text" in table
    spec = json.loads(out_json.read_text())["meta"]["speculative"]
    assert spec["draft_tokens"] == 3 and spec["drafter"] == "prompt-lookup"
    rows = spec["rows"]
    assert [(r["workload"], r["bucket"]) for r in rows] == [("quotes its prompt", 1), ("quotes its prompt", 2),
                                                            ("free text", 1), ("free text", 2)]
    for r in rows:
        assert r["plain_tps"] > 0 and r["spec_tps"] > 0 and r["speedup"] == r["spec_tps"] / r["plain_tps"]
        assert 0 <= r["acceptance"] <= 1 and all(c > 0 for c in r["verify_over_decode"].values())


@pytest.mark.parametrize("bits", [None, 4])
def test_random_model_folder_loads_in_mlx_lm_and_decodes_compiled(tmp_path, bits):
    """benchmarks/make_random_mlx_model.py (the GPU bench's models): a folder
    of the asked shape and format, the tokenizer's vocabulary, that mlx-lm
    loads and the compiled loop decodes exactly as mlx-lm's eager greedy."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    from mlx_tracer import Engine
    from .helpers import save_model_dir

    tok = save_model_dir(tmp_path / "tok")  # a WordLevel tokenizer of 1,000-odd ids
    out = tmp_path / "rnd"
    cmd = [sys.executable, "benchmarks/make_random_mlx_model.py", "--shape", "tiny", "--tokenizer", str(tok),
           "--out", str(out)] + (["--bits", str(bits)] if bits else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == json.loads((tok / "config.json").read_text())["vocab_size"]
    assert ("quantization" in cfg) == bool(bits) and cfg["hidden_size"] == 64
    model, _ = mlx_lm_load(str(out))
    prompt = [3, 1, 4, 1, 5]
    eager = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)), range(6))]
    eng = Engine(model, buckets=(1,))
    eng.add(prompt, max_tokens=6)
    assert [ev.token for ev in eng.run()] == eager


def test_context_ratio_script_takes_turns_and_prints_a_ratio_per_bucket():
    """benchmarks/context_ratio.py (the K/V issue's 1024/128 ratio, the contexts in turns) on
    SmolLM2's file, a few tokens: one row per bucket, its ratio the medians' quotient."""
    cmd = [sys.executable, "benchmarks/context_ratio.py", "--kv-dtype", "float16", "--buckets", "1", "2",
           "--contexts", "16", "48", "--tokens", "2", "--reps", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        short, long_, ratio = float(r[1]), float(r[2]), float(r[3])
        assert short > 0 and long_ > 0 and ratio == pytest.approx(long_ / short, abs=0.006)
        assert len(r[4:]) == 2  # one ratio a pair of runs
    bad = subprocess.run([sys.executable, "benchmarks/context_ratio.py", "--reps", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "positive" in bad.stderr


def test_the_isa_rates_script_measures_each_operation_and_the_split_contracts_ceiling():
    """benchmarks/isa_rates.py (a C program built with the system's compiler, one
    core): a positive rate per operation and pair, and the split contract's
    cycles per 64 multiply-adds of an x row turned into a rate at the measured clock."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in cpu or " fma" not in cpu:
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA")
    cmd = [sys.executable, "benchmarks/isa_rates.py", "--reps", "1", "--loops", "2000000"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    clock = float(re.search(r"clock ~([0-9.]+) GHz", out.stdout).group(1))
    rates = re.findall(r"^  (v[a-z0-9 +]+?)\s+([0-9.]+) a cycle$", out.stdout, re.M)
    assert [name for name, _ in rates][:5] == ["vpmaddubsw", "vpmaddwd", "vpaddd", "vpunpckldq", "vfmadd231ps"]
    assert len(rates) == 8 and all(float(r) > 0 for _, r in rates)
    cycles, rate = re.search(r"([0-9.]+) cycles per 64 multiply-adds of an x row: ([0-9.]+) G", out.stdout).groups()
    assert clock > 0 and float(rate) == pytest.approx(64 / float(cycles) * clock, rel=0.01)
    bad = subprocess.run([sys.executable, "benchmarks/isa_rates.py", "--reps", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "positive" in bad.stderr


def test_the_speculation_ceiling_replays_prompts_the_bench_does_not_run():
    """benchmarks/spec_ceiling.py --workload takes the bench's workloads and one
    it does not run (a policy judged on text it was not tuned on); another name
    is refused before a model loads."""
    from mlx_tracer.bench.speculative import REPLAY_WORKLOADS, WORKLOADS

    assert {name: REPLAY_WORKLOADS[name] for name in WORKLOADS} == WORKLOADS
    extra = REPLAY_WORKLOADS["edits its prompt"]
    assert len(set(extra)) == 8 and not set(extra) & {p for ps in WORKLOADS.values() for p in ps}
    bad = subprocess.run([sys.executable, "benchmarks/spec_ceiling.py", "--workload", "no such"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'edits its prompt'" in bad.stderr, bad.stderr[-2000:]


def test_packed_attention_script_compares_the_two_arithmetics():
    """benchmarks/packed_attention.py on SmolLM2's file, a few tokens: a line per bucket."""
    cmd = [sys.executable, "benchmarks/packed_attention.py", "--buckets", "1", "--context", "40", "--tokens", "2",
           "--reps", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("B1:"))
    m = re.match(r"B1: factored ([\d.]+), dequantized ([\d.]+) tok/s: ([\d.]+)x \(pairs ([\d.]+)\)$", line)
    assert m, line
    f, d, ratio = (float(m.group(i)) for i in (1, 2, 3))
    assert f > 0 and d > 0 and ratio == pytest.approx(f / d, abs=0.006)
