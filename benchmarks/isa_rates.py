"""How many vector operations a core of this CPU retires a cycle, for the
operations qmm's AVX2 tiles are made of, and what that bounds.

    python benchmarks/isa_rates.py [--reps 3] [--loops 100000000]

Writes a small C program to a temporary folder, builds it with the system's
``cc`` (``-O2 -mavx2 -mfma``; x86-64 CPUs with AVX2 and FMA only) and runs it
on one core. The clock is measured, not read: a chain of dependent scalar adds
retires one a cycle. Each rate is then ten independent chains of one
operation (or of two, alternating) on registers, ``--loops`` rounds: the
operations a cycle the core sustains when nothing else limits it. Per
operation: ``vpmaddubsw`` and ``vpmaddwd`` (the integer products of the fast
and split contracts), ``vpaddd``, ``vpunpckldq`` (the transposes of a quad's
sums), ``vfmadd231ps``, and the pairs that show which of them share pipes.

The split contract's products (qmm_ops_x86.h ``split_pairs``: per 64
weights and x row, 4 ``vpmaddubsw``, 2 ``vpmaddwd`` and 3 adds), run as two
independent rows on registers, give the cycles per 64 multiply-adds of one x
row and the multiply-adds a second per core that the split arithmetic
cannot exceed on this CPU: the ceiling of an x row's cost in a tile of
several rows (a verify window, batched decode), before the loads, unpacking,
transposes and scaling a real tile adds. The median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile

CHAINS = 10
SINGLE = {
    "vpmaddubsw": "c{j} = _mm256_maddubs_epi16(c{j}, b);",
    "vpmaddwd": "c{j} = _mm256_madd_epi16(c{j}, b);",
    "vpaddd": "c{j} = _mm256_add_epi32(c{j}, b);",
    "vpunpckldq": "c{j} = _mm256_unpacklo_epi32(c{j}, b);",
    "vfmadd231ps": "f{j} = _mm256_fmadd_ps(f{j}, g, g);",
}
SPLIT_ROWS = 2
PAIRS = {
    "vpmaddubsw + vpmaddwd": ("vpmaddubsw", "vpmaddwd"),
    "vpmaddubsw + vpaddd": ("vpmaddubsw", "vpaddd"),
    "vpmaddubsw + vfmadd231ps": ("vpmaddubsw", "vfmadd231ps"),
}


def _test(name: str, ops) -> str:
    """A block of its own (its chains' registers declared there: nothing spilled)."""
    body = "".join(ops[j % len(ops)].format(j=j) for j in range(CHAINS))
    used = [f"{v}{j}" for v in "cf" for j in range(CHAINS) if f"{v}{j} =" in body]
    decl = "".join(f"__m256i {u} = _mm256_set1_epi16({j + 1});" if u[0] == "c" else f"__m256 {u} = _mm256_set1_ps({j + 1});"
                   for j, u in enumerate(used))
    keep = "".join(f'__asm__ volatile("" : "+x"({u}));' for u in used)
    return (f'{{ {decl} double t0 = now(); for (long i = 0; i < n; ++i) {{ {body} {keep} }} '
            f'printf("%s\\t%.3f\\n", "{name}", {CHAINS}.0 * n / ((now() - t0) * hz)); }}')


def source() -> str:
    """The C program: prints the clock, then ``name<TAB>operations a cycle`` per test."""
    tests = [_test(k, [v]) for k, v in SINGLE.items()]
    tests += [_test(k, [SINGLE[a], SINGLE[b]]) for k, (a, b) in PAIRS.items()]
    # two independent rows: their 8 x vectors opaque every round (so no product is loop-invariant), 2
    # accumulators and 4 constants fit the 16 registers
    rows = "".join(
        f"{{ const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x{r}a), _mm256_maddubs_epi16(w1, x{r}b)); "
        f"const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x{r}c), _mm256_maddubs_epi16(w1, x{r}d)); "
        f"a{r} = _mm256_add_epi32(a{r}, _mm256_add_epi32(_mm256_madd_epi16(p, k128), _mm256_madd_epi16(q, k1))); }}"
        for r in range(SPLIT_ROWS))
    xs = ", ".join(f"x{r}{s} = _mm256_set1_epi8({r + 1})" for r in range(SPLIT_ROWS) for s in "abcd")
    keep = "".join(f'__asm__ volatile("" : "+x"(a{r}));' for r in range(SPLIT_ROWS))
    keep += "".join(f'__asm__ volatile("" : "+x"(x{r}{s}));' for r in range(SPLIT_ROWS) for s in "abcd")
    split = (f"{{ __m256i a0 = _mm256_setzero_si256(), a1 = a0, {xs}; "
             "const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), k128 = _mm256_set1_epi16(128), "
             "k1 = _mm256_set1_epi16(1); "
             f"double t0 = now(); for (long i = 0; i < n; ++i) {{ {rows} {keep} }} "
             f'printf("split\\t%.3f\\n", (now() - t0) * hz / ({SPLIT_ROWS}.0 * n)); }}')
    decl = "const __m256i b = _mm256_set1_epi8(1); const __m256 g = _mm256_set1_ps(1.0001f);"
    return "\n".join([
        "#include <immintrin.h>", "#include <stdio.h>", "#include <stdlib.h>", "#include <time.h>",
        "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); "
        "return t.tv_sec + t.tv_nsec * 1e-9; }",
        "int main(int argc, char** argv) {",
        "  const long n = atol(argv[1]); long x = 0;",
        "  double t0 = now();",
        '  for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0\\n\\tadd $1, %0" '
        ': "+r"(x));',
        "  const double hz = 4.0 * n / (now() - t0);",
        '  printf("clock\\t%.4f\\n", hz / 1e9);',
        "  " + decl,
        *("  " + t for t in tests),
        "  " + split,
        "  return (int)(x & 1);",
        "}",
    ])


def build(folder: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if cc is None:
        raise SystemExit("no C compiler (cc, gcc or g++) on PATH")
    src, exe = os.path.join(folder, "rates.c"), os.path.join(folder, "rates")
    with open(src, "w") as f:
        f.write(source())
    subprocess.run([cc, "-O2", "-mavx2", "-mfma", "-x", "c", src, "-o", exe], check=True)
    return exe


def run(exe: str, loops: int) -> dict:
    out = subprocess.run([exe, str(loops)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split("\t") for line in out.splitlines())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loops", type=int, default=100_000_000)
    args = ap.parse_args()
    if args.reps < 1 or args.loops < 1:
        ap.error("--reps and --loops take positive integers")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in flags or " fma" not in flags:
        raise SystemExit("this benchmark needs an x86-64 CPU with AVX2 and FMA")
    with tempfile.TemporaryDirectory() as d:
        exe = build(d)
        runs = [run(exe, args.loops) for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"one core, clock ~{med['clock']:.2f} GHz (measured), load average {os.getloadavg()[0]:.2f}; "
          f"median of {args.reps} runs")
    for k in list(SINGLE) + list(PAIRS):
        print(f"  {k:26s} {med[k]:5.2f} a cycle")
    cycles = med["split"]
    print(f"  split contract's products   {cycles:5.2f} cycles per 64 multiply-adds of an x row: "
          f"{64 / cycles * med['clock']:.1f} G multiply-adds/s a core at most")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
