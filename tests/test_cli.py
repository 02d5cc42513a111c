"""The console script, run as a user runs it."""

from __future__ import annotations

import subprocess

import pytest

from .helpers import CLI, model_present


def run(*args, timeout=300):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


needs_model = pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")


@pytest.mark.model
@needs_model
def test_generate_prints_the_answer_and_a_summary():
    r = run("generate", "What is the capital of France? Answer in one sentence.", "--max-tokens", "16", "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode:" in r.stderr and "tok/s" in r.stderr and "traces:" in r.stderr


@pytest.mark.model
@needs_model
def test_generate_batch_and_trace_with_dot(tmp_path):
    r = run("generate", "Hi", "Name a color.", "--max-tokens", "4", "--buckets", "1,2", "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "[0]" in r.stdout and "[1]" in r.stdout
    dot = tmp_path / "decode.dot"
    r = run("trace", "--buckets", "1", "--dot", str(dot), "--weights", "as-is")
    assert r.returncode == 0, r.stderr
    assert "decode       1    1" in r.stdout
    assert dot.exists() and "QuantizedMatmul" in r.stdout


@pytest.mark.model
@needs_model
def test_generate_with_speculative_decoding_reports_acceptance():
    text = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue."
    r = run("generate", text, "--max-tokens", "16", "--weights", "as-is", "--spec", "prompt-lookup", "--draft-tokens", "3",
            "--spec-policy", "always")
    assert r.returncode == 0, r.stderr
    assert "red" in r.stdout and "speculative:" in r.stderr and "drafts accepted" in r.stderr


def test_bad_input_gives_clear_errors(tmp_path):
    r = run("generate", "hello", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "mlx-tracer fetch" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run("generate", "hello", "--model", str(bad))
    assert r.returncode == 2 and "not a GGUF" in r.stderr
    r = run("generate", "hello", "--max-tokens", "0")
    assert r.returncode == 2 and "argument --max-tokens: must be > 0" in r.stderr
    r = run("generate", "  ")
    assert r.returncode == 2 and "empty prompt" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "argument --seed: a seed is an integer from 0 to"),
        (["--seed", "x"], "argument --seed: expected an integer seed"),
        (["--buckets", "0"], "argument --buckets: 0 in '0': each must be >= 1"),
        (["--buckets=-2,4"], "argument --buckets: -2 in '-2,4': each must be >= 1"),
        (["--buckets", "-2,4"], "argument --buckets: expected one argument"),  # argparse: an option, not a value
        (["--buckets", ""], "argument --buckets: expected comma-separated positive integers"),
        (["--buckets", "1,two"], "argument --buckets: expected comma-separated positive integers"),
        (["--max-tokens", "-3"], "argument --max-tokens: must be > 0, got -3"),
        (["--temp", "-0.5"], "argument --temp: a temperature is a finite number >= 0"),
        (["--temp", "nan"], "argument --temp: expected a temperature"),
        (["--top-p", "0"], "argument --top-p: top-p is a probability in (0, 1]"),
        (["--min-p", "2"], "argument --min-p: min-p is a probability in [0, 1]"),
        (["--top-k", "-1"], "argument --top-k: must be >= 0"),
        (["--spec", "medusa"], "argument --spec: invalid choice"),
        (["--spec", "prompt-lookup", "--draft-tokens", "0"], "argument --draft-tokens: must be > 0"),
        (["--spec", "prompt-lookup", "--draft-tokens", "600"], "draft_tokens must be in [1, 64]"),
        (["--draft-model", "/nonexistent/draft.gguf"], "that path does not exist"),
        (["--spec", "prompt-lookup", "--draft-model", "x.gguf"], "not allowed with argument"),
    ],
)
def test_bad_options_exit_2_before_the_model_loads(args, message):
    r = run("generate", "hello", "--model", "/nonexistent/model.gguf", *args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr and r.stdout == ""


def test_invalid_utf8_in_argv_is_a_clear_error():
    r = subprocess.run([CLI, "generate", b"caf\xe9 \xff"], capture_output=True, timeout=60)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert "argument 2 ('caf\\udce9 \\udcff') is not valid UTF-8 text (byte 0xe9)" in err, err
    assert "Traceback" not in err and r.stdout == b""


def test_trace_and_bench_options_are_checked_too():
    r = run("trace", "--buckets", "0,1", timeout=60)
    assert r.returncode == 2 and "argument --buckets" in r.stderr
    for args in (["--tokens", "0"], ["--runs", "-1"], ["--contexts", "-5"], ["--models", ","]):
        r = run("bench", *args, timeout=60)
        assert r.returncode == 2 and f"argument {args[0]}" in r.stderr, (args, r.stderr)
