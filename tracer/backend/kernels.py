"""CPU kernels for the lean decode forward: MLX primitives of our own.

On MLX's CPU backend ``mx.fast.rms_norm`` / ``rope`` run their multi-node
fallbacks, and a compiled step's host cost grows with its node count
(``benchmarks/replay_cost.py`` measures it). ``kernels.cpp`` defines
primitives that do in one node what the lean forward's MLX ops
(:mod:`mlx_tracer.adapters.lean.ops`) do in many, **bit for bit** (MLX's own
element functors, in the same order, compiled as MLX compiles its CPU
kernels; ``tests/test_kernels.py``):

* ``layer_in``: a decode step's layer up to attention: the previous MLP's
  down projection and residual, the input norm, the q/k/v projection,
  qwen3's per-head q/k norms where given, and RoPE;
* ``cache_write``: the new key or value at the step's column of a cache
  buffer (float32, or float16/bfloat16 as ``astype`` converts), in place
  when MLX may donate the buffer (the test MLX's own ``slice_update`` makes,
  ``array::is_donatable``);
* ``layer_mid``: attention, the output projection and residual, the
  post-attention norm, gate/up and SwiGLU; the cached K/V read as stored:
  float32; float16/bfloat16 widened one (row, key head) block at a time
  into per-thread scratch and multiplied with the ``cblas_sgemm`` call MLX's
  matmul makes after promoting them (the same bits); 4-/8-bit packed columns
  (mlx-lm's ``QuantizedKVCache`` layout, float32 scales) with the arithmetic
  of MLX's CPU ``quantized_matmul`` (each score or output a sum in order of
  ``x * (scale * q + bias)``, no fused multiply-add; AVX-512, AVX2 or
  scalar, ``kv_isa()`` / ``kv_set_isa()`` / ``MLX_TRACER_KV_ISA``, the same
  bits); never a float32 copy of the cache;

together a decode layer is 4 graph nodes instead of 27 on MLX's ops. Both
layer kernels also take a window of L tokens a row (verify and prefill
steps; the cache then written by the cache's own ``update_and_fetch``). A float32
projection is computed with the ``cblas_sgemm`` call MLX's CPU matmul makes
for the same operands; one given as MLX's packed 4-/8-bit blocks (or qmm's
5- and 6-bit ones) with ``qmm`` (below), as the lean ops path computes it. Activations are float32,
CPU only; the lean forward plans them for decode steps where every
projection is one of the two (:mod:`mlx_tracer.adapters.lean.native`) and
runs MLX's ops elsewhere.

The same module holds ``qmm`` (``qmm.cpp``): ``x @ mx.dequantize(w, scales,
biases, group_size, bits).T`` for MLX's affine 4- and 8-bit weights, read
packed, float32 out. Its contract is *exact*, not bit for bit: each weight is
MLX's float32 dequantization (``scale * q + bias``, float16/bfloat16 scales
widened to float32 first; ``mx.dequantize`` itself computes in the scales'
type), products summed in float32, equal to the float32 matmul up to the
order of summation (``tests/test_qmm.py``); its *factored* contract sums
``scale * sum(q x) + bias * sum(x)`` per group instead, its *fast* one
multiplies int8 activations as integers (``qmm.cpp`` states both). The lean forward calls it for
quantized projections: inside the layer kernels on decode steps, as a node
of its own in windows and for the output head.

Each kernel's inputs are described once, in ``kernels.cpp`` (one list per
kernel that gives the slots, their names and which are optional): the
binding takes them as a dict by those names, and ``inputs(kernel)`` lists
them. The kernels use MLX's public C++ API only (``mlx/array.h``,
``mlx/primitives.h``, ``mlx/scheduler.h``, the CPU encoder); a release that
changes it fails the build, and the kernels are then off with the reason.

Building: the source is compiled at first use with the C++ compiler MLX's
CPU backend needs for its own kernel JIT (``$CXX`` or ``g++``), against the
headers and ``libmlx`` inside the installed ``mlx`` wheel and nanobind's
sources (the ``nanobind`` package, a Linux dependency), about 10 s, and kept
in the cache folder (:mod:`mlx_tracer.home`) as ``kernels-<key><suffix>``
with its sha256 next to it; the key covers the sources, the flags and the
versions of mlx, nanobind and Python. The module is built in nanobind's
``mlx`` domain, as MLX's own bindings are, so its functions take
``mx.array``; a build whose functions refuse them (a nanobind that does not
match the one mlx was built with) is not used.

``MLX_TRACER_KERNELS=0`` turns them off. Anything that goes wrong (no
compiler, no nanobind, a failed build) leaves them off with the reason in
:func:`status` (``mlx-tracer info``), never an error: the forward then runs
MLX's ops, with the same results.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..home import cache_dir, check_kept, keep_built, writable_cache_dir

ENV = "MLX_TRACER_KERNELS"
SOURCES = [Path(__file__).with_name(name) for name in ("kernels.cpp", "qmm.cpp", "logprobs.cpp")]
HEADERS = [Path(__file__).with_name(name)  # included by qmm.cpp
           for name in ("qmm_api.h", "qmm_isa.h", "qmm_pool.h", "qmm_fast.h", "qmm_factored.h", "qmm_ops_portable.h",
                        "qmm_ops_x86.h", "qmm_narrow_x86.h", "vmath_x86.h", "attend_x86.h", "attend_common.h")]
MODULE = "_mlx_tracer_kernels"
# As MLX 0.32 builds its CPU kernels (`g++ -std=c++17 -O3`, no -march: no
# contraction into fused multiply-adds), in C++20 for MLX's headers.
FLAGS = ["-std=c++20", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-DNB_DOMAIN=mlx", "-DNDEBUG", "-w"]

_state = {"tried": False, "module": None, "why": None}


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("mlx", "nanobind"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _paths():
    """(mlx's package folder, nanobind's package folder)."""
    import mlx.core as mx
    import nanobind

    return Path(mx.__file__).parent, Path(nanobind.__file__).parent


def module_file() -> Path:
    v = _versions()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = "|".join([*(p.read_text() for p in SOURCES + HEADERS), " ".join(FLAGS), str(QMM_UNITS), str(v), suffix,
                    sys.version])
    return cache_dir() / f"kernels-{hashlib.sha1(key.encode()).hexdigest()[:12]}{suffix}"


# qmm.cpp's units (its TRACER_QMM_UNIT): the AVX2 kernels, the AVX-512 ones,
# the rest. Whole, it was 76 s of a 101 s build's CPU time (2-core Zen 3).
QMM_UNITS = (1, 2, 0)


def _units(nb_dir: Path) -> list:
    """(source, extra flags) for each object: qmm.cpp's units first (the
    rest unit, 0, ~35 s here; AVX-512 ~23 s; AVX2 ~18 s), then the others."""
    by_name = {src.name: src for src in SOURCES}
    qmm = [(by_name["qmm.cpp"], [f"-DTRACER_QMM_UNIT={u}"]) for u in QMM_UNITS]
    rest = [(by_name["kernels.cpp"], []), (nb_dir / "src" / "nb_combined.cpp", []), (by_name["logprobs.cpp"], [])]
    return qmm + rest


def _compile(out: Path) -> None:
    """Builds the module at ``out``: each unit compiled on its own, as many at
    once as this process has cores (qmm.cpp's units first, see QMM_UNITS),
    then linked. One g++ call for all compiled them one after another: ~95 s
    on a 2-core Zen 3; the sources side by side ~77 s, about the time of
    qmm.cpp alone; with qmm.cpp in three units, ~51 s. The next
    free core goes to whichever unit ends first."""
    mlx_dir, nb_dir = _paths()
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise OSError("no C++ compiler (g++) to build the kernels; MLX's CPU compile needs one too")
    py_include = sysconfig.get_paths()["include"]
    includes = [f"-I{nb_dir / 'include'}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
                f"-I{mlx_dir / 'include'}", f"-I{py_include}"]
    units = _units(nb_dir)
    objects = [out.with_name(f"{i}-{src.stem}.o") for i, (src, _) in enumerate(units)]
    compile_flags = [f for f in FLAGS if f != "-shared"]
    commands = [[cxx, *compile_flags, *defines, "-c", *includes, str(src), "-o", str(obj)]
                for (src, defines), obj in zip(units, objects)]
    link = [cxx, *FLAGS, *map(str, objects), f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
            "-o", str(out)]
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    pending, running, failed = [(src, cmd) for (src, _), cmd in zip(units, commands)], {}, None
    while (pending or running) and failed is None:
        while pending and len(running) < cores:
            src, cmd = pending.pop(0)
            log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty unit never blocks on it
            running[subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)] = (src, log)
        done = next((proc for proc in running if proc.poll() is not None), None)
        if done is None:  # the next free core goes to whichever unit ends first
            time.sleep(0.05)
            continue
        src, log = running.pop(done)
        log.seek(0)
        said = log.read().strip()
        log.close()
        if done.returncode != 0:
            failed = said or f"{cxx} exited with status {done.returncode} on {src.name}"
    for proc, (_, log) in running.items():  # a unit failed: the others are not needed
        proc.kill()
        proc.wait()
        log.close()
    if failed is None:
        linked = subprocess.run(link, capture_output=True, text=True)
        failed = None if linked.returncode == 0 else ((linked.stderr or linked.stdout).strip()
                                                      or f"{cxx} exited with status {linked.returncode} linking")
    if failed is not None:
        tail = failed.splitlines()[-5:]
        raise OSError("kernel build failed: " + " | ".join(tail))


def _import(path: Path, verify: bool = True):
    if verify:
        check_kept(path)
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(target: Path):
    folder = writable_cache_dir()
    with tempfile.TemporaryDirectory(prefix=".kernels-build-", dir=folder) as tmp:
        out = Path(tmp) / target.name
        _compile(out)
        if folder is None:
            return _import(out, verify=False)  # stays mapped after the folder is gone
        keep_built(out, target, "kernels-")
    return _import(target)


def _check(module) -> None:
    """The functions must take mx.array (same nanobind domain and ABI as mlx)."""
    import mlx.core as mx

    try:
        got = module.cache_write(mx.zeros((1, 1, 2, 2)), mx.ones((1, 1, 1, 2)), mx.array([1], dtype=mx.int32))
        mx.eval(got)
    except TypeError as e:
        raise OSError(f"the kernels do not accept mx.array (nanobind does not match mlx's): {e}") from None


def load():
    """The kernels module, built if need be; ``None`` when off or unavailable
    (:func:`status` says why). Tried once per process."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
        _state["why"] = f"off ({ENV}=0)"
        return None
    try:
        import mlx.core as mx

        if mx.default_device().type != mx.DeviceType.cpu:
            _state["why"] = "not on the CPU backend"
            return None
        if _versions()["nanobind"] is None:
            raise OSError("nanobind is not installed (pip install nanobind)")
        target = module_file()
        module = None
        if target.exists():
            try:
                module = _import(target)
            except (OSError, ImportError):
                module = None  # damaged or stale: rebuilt below
        if module is None:
            module = _build(target)
        _check(module)
    except Exception as e:  # never an error: MLX's ops serve instead
        _state["why"] = str(e)
        return None
    _state["module"] = module
    return module


_ATTENTION = {  # MLX_TRACER_ATTENTION
    "auto": "on vector lanes beside packed projections, MLX's BLAS calls beside float32 ones",
    "blas": "on MLX's BLAS calls (MLX_TRACER_ATTENTION=blas)",
    "vector": "on vector lanes (MLX_TRACER_ATTENTION=vector)",
}

_PACKED = {  # MLX_TRACER_PACKED_ATTENTION
    "factored": "quantized K/V of one group a row factored",
    "dequantized": "quantized K/V of one group a row dequantized as MLX does (MLX_TRACER_PACKED_ATTENTION=dequantized)",
}


def _packed_isa(module) -> str:
    """The factored keys' integer products run on the fast contract's int8 kernels' ISA (attend_x86.h)."""
    if module.packed_attention() != "factored":
        return ""
    return f" (the keys' products in integers: {module.qmm_int8_isa()})"


def status() -> str:
    """One line for ``mlx-tracer info``."""
    module = load()
    if module is not None:
        return (f"active: the lean layers on the CPU, decode and windows (4 graph nodes a decode layer; float32 or "
                f"packed 4-/5-/8-bit projections); quantized matmul {module.qmm_isa()} (integer products: "
                f"{module.qmm_int8_isa()}), {module.qmm_threads()} threads; "
                f"decode attention {_ATTENTION[module.attention_mode()]}, {_PACKED[module.packed_attention()]}"
                f"{_packed_isa(module)} "
                f"({Path(module.__file__).name})")
    return f"not used: {_state['why']}"
