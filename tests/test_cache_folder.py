"""The cache folder heals, and a read-only one is no error
(tracer/home.py, tracer/backend/blas.py, tracer/loading/format_cache.py).
Each case runs in a fresh interpreter with its own $MLX_TRACER_HOME."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_tracer.backend import blas

from .helpers import CLI, model_present

STATUS = "import mlx_tracer\nfrom mlx_tracer.backend import blas\ns = blas.status()\nprint('FAST' if s.fast else 'REFERENCE', s.library)"


def run(args, home, **extra):
    env = dict(os.environ, MLX_TRACER_HOME=str(home), **extra)
    env.pop("MLX_TRACER_BLAS", None)  # the suite pins the reference BLAS; these runs do not
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` refuses writes, also for root (immutable attribute), or the test skips."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"running as root and `chattr +i` failed ({r.stderr.strip()}): no read-only folder to test with")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.skipif(blas.openblas_path() is None, reason="scipy-openblas32 not installed")
@pytest.mark.parametrize("junk", [b"", b"junk bytes, not a shared library", "truncated"])
def test_a_corrupt_blas_shim_is_rebuilt(tmp_path, junk):
    home = tmp_path / "home"
    r = run([sys.executable, "-c", STATUS], home)  # builds a good shim
    assert r.returncode == 0 and r.stdout.startswith("FAST"), r.stderr
    shim = Path(r.stdout.split()[1])
    assert shim.parent == home
    good = shim.read_bytes()
    shim.write_bytes(good[: len(good) // 3] if junk == "truncated" else junk)
    r = run([sys.executable, "-c", STATUS], home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAST"), (r.stdout, r.stderr)
    assert "fast BLAS not active" not in r.stderr
    assert shim.read_bytes()[:4] == b"\x7fELF" and shim.stat().st_size == len(good)


@pytest.mark.skipif(blas.openblas_path() is None, reason="scipy-openblas32 not installed")
def test_a_read_only_home_still_gets_the_fast_blas_and_says_so_once(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with read_only(home):
        r = run([sys.executable, "-c", STATUS + "\nfrom mlx_tracer import home\nhome.writable_cache_dir()"], home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAST") and "blas-shim" in r.stdout, r.stdout
    assert r.stderr.count("is not writable") == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert list(home.iterdir()) == []


@pytest.mark.model
@pytest.mark.skipif(not model_present(), reason="SmolLM2 GGUF not present: run `mlx-tracer fetch`")
def test_generate_and_info_with_a_read_only_home_run_without_caching(tmp_path):
    from mlx_tracer.loading.store import MODEL_FILENAME, resolve_model

    home = tmp_path / "home"
    home.mkdir()
    (home / MODEL_FILENAME).symlink_to(resolve_model())
    (home / "formats.json").write_text("[]")  # wrong shape, and it cannot be rebuilt here
    with read_only(home):
        # without the native kernels: building them (~50 s here) is the next
        # test's, and `auto` times as-is and float32 only
        r = run([CLI, "generate", "What is the capital of France?", "--max-tokens", "8", "--weights", "auto"], home,
                MLX_TRACER_KERNELS="0")
        i = run([CLI, "info"], home, MLX_TRACER_KERNELS="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no answer"
    assert r.stderr.count("is not writable") == 1, r.stderr
    assert r.stderr.count("formats.json: not a version-2 formats file (list): ignoring") == 1, r.stderr
    assert "Traceback" not in r.stderr and "PermissionError" not in r.stderr
    assert i.returncode == 0 and "Traceback" not in i.stderr, i.stderr
    assert sorted(p.name for p in home.iterdir()) == sorted(["formats.json", MODEL_FILENAME])
    assert json.loads((home / "formats.json").read_text()) == []


KERNELS_WITHOUT_A_CACHE = """
import shutil, sys
from pathlib import Path
import mlx_tracer
import mlx.core as mx
from mlx_tracer.backend import kernels

def compile_(out):  # the build's output, as g++ gives it (the real compile: test_kernels.py, ./dev setup)
    shutil.copyfile(sys.argv[1], out)

kernels._compile = compile_
K = kernels.load()
assert K is not None, kernels.status()
x, w = mx.ones((1, 64)), mx.ones((8, 64))
wq, s, b = mx.quantize(w, group_size=32, bits=4)
got = K.qmm(x, wq, s, b, 32, 4)
print(Path(K.__file__).parent.name, Path(K.__file__).exists(), float(mx.abs(got - x @ mx.dequantize(wq, s, b, group_size=32, bits=4).T).max()))
"""


def test_a_read_only_home_builds_the_kernels_in_a_temporary_folder_and_keeps_nothing(tmp_path):
    """The kernels' build lands in a temporary folder, is loaded from there
    (the folder gone, the module stays mapped) and is not kept; the home is
    not written. The compile itself is this suite's cached build copied in
    (a real one takes ~50 s on 2 cores)."""
    from mlx_tracer.backend import kernels

    if kernels.load() is None:
        pytest.skip(f"native kernels unavailable: {kernels.status()}")
    built = Path(kernels.load().__file__)
    home = tmp_path / "home"
    home.mkdir()
    with read_only(home):
        r = run([sys.executable, "-c", KERNELS_WITHOUT_A_CACHE, str(built)], home)
    assert r.returncode == 0, r.stderr
    folder, there, err = r.stdout.split()
    assert folder.startswith(".kernels-build-") or folder.startswith("tmp"), folder
    assert there == "False"  # its temporary folder is gone
    assert float(err) < 1e-4, err
    assert r.stderr.count("is not writable") == 1, r.stderr
    assert list(home.iterdir()) == []


def _age(path: Path, days: float) -> None:
    import time

    t = time.time() - days * 86400
    os.utime(path, (t, t))


def test_old_builds_of_a_kind_are_pruned_when_a_new_one_lands_and_used_ones_stay(tmp_path):
    """Each new shim/kernel build has a new name; builds nothing has loaded
    for STALE_DAYS go when the next one of their kind is kept, with their
    sha256 files. Loading a build marks it used."""
    from mlx_tracer import home

    def built(name: str, days: float, digest: bool = True) -> Path:
        p = tmp_path / name
        p.write_bytes(name.encode())
        if digest:
            (tmp_path / (name + ".sha256")).write_text(home._sha256(p.read_bytes()) + "\n")
        _age(p, days)
        return p

    stale = built("kernels-aaa.so", home.STALE_DAYS + 5)
    no_digest = built("kernels-bbb.so", home.STALE_DAYS + 1, digest=False)
    recent = built("kernels-ccc.so", home.STALE_DAYS - 5)
    in_use = built("kernels-ddd.so", home.STALE_DAYS + 9)
    other_kind = built("blas-shim-eee.so", home.STALE_DAYS + 9)
    (tmp_path / "kernels-fff.so.sha256").write_text("digest of a build that is gone\n")
    _age(tmp_path / "kernels-fff.so.sha256", home.STALE_DAYS + 1)
    (tmp_path / "kernels-ggg.so.sha256").write_text("another process's build, about to move in\n")
    home.check_kept(in_use)  # loaded: marked used
    build_dir = tmp_path / ".kernels-build-x"
    build_dir.mkdir()
    out = build_dir / "kernels-new.so"
    out.write_bytes(b"new build")

    home.keep_built(out, tmp_path / "kernels-new.so", "kernels-")

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([
        ".kernels-build-x", "blas-shim-eee.so", "blas-shim-eee.so.sha256", "kernels-ccc.so", "kernels-ccc.so.sha256",
        "kernels-ddd.so", "kernels-ddd.so.sha256", "kernels-ggg.so.sha256", "kernels-new.so", "kernels-new.so.sha256",
    ])
    assert not stale.exists() and not no_digest.exists() and recent.exists() and other_kind.exists()
    home.check_kept(tmp_path / "kernels-new.so")  # the kept build verifies
    # the target itself is never pruned, however old
    _age(tmp_path / "kernels-new.so", home.STALE_DAYS * 3)
    assert home.prune_stale(tmp_path / "kernels-new.so", "kernels-") == []
    assert (tmp_path / "kernels-new.so").exists()
