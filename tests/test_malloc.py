"""The mlx-tracer command runs under mimalloc (tracer/backend/malloc.py): it
starts itself again with mimalloc preloaded, once, before any model loads;
``MLX_TRACER_MALLOC`` switches it off or names another library; the bench's
other systems run under the system's malloc. Each check runs the command in
a fresh process: a process's malloc is fixed when it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlx_tracer.backend import malloc

from .helpers import CLI, FRANCE, SYSTEM, model_present

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc.mimalloc_path() is None,
    reason="mimalloc is preloaded on Linux, from the cmeel-mimalloc wheel",
)

# a child that reports what serves malloc in it, and whether the command's mark reached it
REPORT = ("import os; from mlx_tracer.backend import malloc; "
          "print(malloc.serving()); print(os.environ.get(malloc.MARK, '-')); "
          "print(os.environ.get('MIMALLOC_PURGE_DELAY', '-'))")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.MARK, malloc.ENV)}
    e.update(extra)
    return e


def cli(*args, **extra):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300, env=env(**extra))


def test_a_plain_python_process_runs_on_glibc_and_says_how_to_preload():
    r = subprocess.run([sys.executable, "-c", REPORT + "; print(malloc.status())"], capture_output=True, text=True,
                       timeout=120, env=env())
    assert r.returncode == 0, r.stderr
    lib, mark, delay, status = r.stdout.splitlines()
    assert "libc.so" in os.path.basename(lib) and mark == "-" and delay == "-"
    assert status.startswith("glibc") and "LD_PRELOAD" in status


def test_the_command_runs_under_mimalloc_and_info_says_so():
    r = cli("info")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("malloc"))
    assert "mimalloc" in line and malloc.mimalloc_path() in line and "preloaded by the mlx-tracer command" in line


def test_the_preload_reaches_the_command_process_itself_once():
    """The second start keeps the interpreter's options (``-X utf8``) and
    arguments; the child a command starts inherits mimalloc and the mark (so
    it never starts again: a loop would hang here)."""
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {REPORT!r}])"
    r = subprocess.run([sys.executable, "-X", "utf8", "-c",
                        "import sys; from mlx_tracer.backend import malloc; malloc.reexec(); " + code],
                       capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 0, r.stderr
    lib, mark, delay = r.stdout.splitlines()
    assert lib == malloc.mimalloc_path() and mark == lib and delay == malloc.PURGE_DELAY_MS
    r = subprocess.run([sys.executable, "-c", "from mlx_tracer.backend import malloc; malloc.reexec(); " + code],
                       capture_output=True, text=True, timeout=120, env=env(MIMALLOC_PURGE_DELAY="-1"))
    assert r.returncode == 0 and r.stdout.splitlines()[2] == "-1", r.stderr  # the user's setting wins


def test_switched_off_it_stays_glibc():
    r = cli("info", MLX_TRACER_MALLOC="system")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("malloc"))
    assert line.split()[1] == "glibc" and "MLX_TRACER_MALLOC=system" in line


def test_another_library_by_path_and_a_bad_path_refused_before_any_load(tmp_path):
    r = cli("info", "--malloc-path", MLX_TRACER_MALLOC=malloc.mimalloc_path())
    assert r.returncode == 0 and r.stdout.strip() == malloc.mimalloc_path()
    missing = tmp_path / "libnothing.so"
    r = cli("generate", "hi", "--model", str(tmp_path / "absent.gguf"), MLX_TRACER_MALLOC=str(missing))
    assert r.returncode == 2
    assert "MLX_TRACER_MALLOC" in r.stderr and "is not a file" in r.stderr and "Traceback" not in r.stderr


def test_a_malloc_the_user_preloaded_stays(tmp_path):
    """Another allocator already preloaded (here a copy of mimalloc under
    another name) is the user's choice: the command does not start again
    over it, and info says whose preload it is."""
    other = tmp_path / "libothermalloc.so"
    other.write_bytes(open(malloc.mimalloc_path(), "rb").read())
    r = subprocess.run([sys.executable, "-c", "from mlx_tracer.backend import malloc; malloc.reexec(); " + REPORT
                        + "; print(malloc.status())"],
                       capture_output=True, text=True, timeout=120, env=env(LD_PRELOAD=str(other)))
    assert r.returncode == 0, r.stderr
    lib, mark, delay, status = r.stdout.splitlines()
    assert lib == str(other.resolve()) and mark == "-" and delay == "-"
    assert status == f"libothermalloc.so ({lib}); preloaded by the user"


def test_bench_workers_start_without_the_commands_preload(monkeypatch):
    """Stock mlx-lm and llama.cpp run as their users start them: the bench's
    worker processes get the environment without mimalloc and its mark."""
    from mlx_tracer.bench import baseline, peer, protocol

    lib = malloc.mimalloc_path()
    monkeypatch.setenv("LD_PRELOAD", lib)
    monkeypatch.setenv(malloc.MARK, lib)
    started = []

    def popen(argv, **kw):  # record what the worker would start with, start nothing
        started.append(kw["env"])
        raise OSError("not started in this test")

    monkeypatch.setattr(protocol.subprocess, "Popen", popen)
    for make in (baseline.BaselineWorker, lambda: peer.PeerWorker(sys.executable)):
        with pytest.raises(OSError):
            make()
    assert len(started) == 2
    for e in started:
        assert "LD_PRELOAD" not in e and malloc.MARK not in e and e.get("PATH") == os.environ.get("PATH")


def test_bench_systems_other_than_ours_run_under_the_system_malloc():
    lib = malloc.mimalloc_path()
    out = malloc.without_preload({"LD_PRELOAD": f"/x/libother.so:{lib}", malloc.MARK: lib, "PATH": "/bin"})
    assert out == {"LD_PRELOAD": "/x/libother.so", "PATH": "/bin"}
    assert malloc.without_preload({"LD_PRELOAD": lib, malloc.MARK: lib}) == {}
    untouched = {"LD_PRELOAD": "/x/libother.so"}  # a preload the user chose stays
    assert malloc.without_preload(untouched) == untouched


@pytest.mark.model
@pytest.mark.skipif(not model_present(), reason="needs the SmolLM2 GGUF file (./dev setup)")
def test_the_same_greedy_text_under_either_malloc():
    args = ("generate", FRANCE, "--system", SYSTEM, "--max-tokens", "12", "--chat")
    a, b = cli(*args), cli(*args, MLX_TRACER_MALLOC="system")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and "Paris" in a.stdout
