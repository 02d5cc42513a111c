"""Sharded models over mx.distributed: 2 ranks on 127.0.0.1 (ring backend).

The ranks run tests/dist_rank.py, started with the environment variables
``mlx.launch`` sets (MLX_RANK, MLX_HOSTFILE), and once through ``mlx.launch``
itself. Direct starts keep the tests fast (mlx.launch's I/O loop busy-polls:
~1.4 of this machine's 2 cores, 10 s instead of 3 s for the main run) and
show how a rank behaves on its own when a peer fails (mlx.launch would kill
the survivor and hide that). Every process runs in its own process group,
bounded by a timeout and killed in a ``finally``.

Measured tolerance: the 2-rank logits differ from the single-process ones by
at most 5.7e-6 (tiny fp32 models whose logits reach ~12: ~5e-7 relative; the
sharded matmuls sum in another order), and are bit-identical across ranks
(every rank reads the same all-summed values). The test allows 5e-5.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_tracer import Generator
from mlx_tracer.runtime.distributed import check_shardable, rank0_text, shard_model, sharded_size
from mlx_tracer.runtime.watchdog import Watchdog

from . import dist_rank
from .helpers import IdTokenizer, write_model_dir
from .tiny_models import _config, tiny_model

HERE = Path(__file__).resolve().parent
RANK = str(HERE / "dist_rank.py")
FAMILIES = ["llama", "llama_mixed"]  # full attention; sliding-window (RotatingKVCache) + full layers
LOGITS_ATOL = 5e-5  # measured max |2 ranks - 1 process|: 5.7e-6 (logits up to ~12)


# ------------------------------------------------------------------ helpers
def unsplittable_config() -> dict:
    """SmolLM2's head counts (9 heads, 3 KV heads) on a tiny llama."""
    return dict(_config("llama"), hidden_size=72, intermediate_size=96, num_attention_heads=9, num_key_value_heads=3)


def free_port_pair() -> int:
    """A port P with P and P+1 free (mlx.launch numbers ranks' ports upwards)."""
    for _ in range(50):
        p = random.randint(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair on 127.0.0.1")


def run_group(cmds, logs: Path, timeout: float, envs=None, wait_for=None):
    """Run commands, each in its own process group with its output in files
    under ``logs``, until the processes ``wait_for`` (default all) end or
    ``timeout`` passes; then kill every group. Returns ``[(returncode or
    None, stdout, stderr)]``."""
    logs.mkdir(parents=True, exist_ok=True)
    envs = envs or [{}] * len(cmds)
    procs = []
    try:
        for i, (c, e) in enumerate(zip(cmds, envs)):
            with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
                procs.append(subprocess.Popen(c, stdout=out, stderr=err, text=True, start_new_session=True,
                                              env=dict(os.environ, **e)))
        deadline = time.monotonic() + timeout
        for i in range(len(procs)) if wait_for is None else wait_for:
            try:
                procs[i].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return [(p.poll(), (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text()) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_ranks(args, tmp: Path, timeout: float, env=None, wait_for=None):
    """Two ranks of tests/dist_rank.py on 127.0.0.1, started with the variables
    mlx.launch sets (MLX_RANK, MLX_HOSTFILE)."""
    port = free_port_pair()
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    envs = [dict(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), **(env or {})) for r in (0, 1)]
    return run_group([[sys.executable, RANK, *map(str, args)]] * 2, tmp / "logs", timeout, envs, wait_for)


def single_process(model_dir: Path):
    gen = Generator.load(model_dir, **dist_rank.OPTIONS)
    tokens = dist_rank.run_plan(gen.engine, lambda e: e.step())
    return tokens, dist_rank.logits_trace(gen.engine.compiled)


# ------------------------------------------------------------ 2-rank runs
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One 2-rank run over every family: results per (family, rank)."""
    root = tmp_path_factory.mktemp("dist")
    bad = write_model_dir(_unsplittable_model(), unsplittable_config(), root / "smollm2_heads")
    dirs = [write_model_dir(tiny_model(f), _config(f), root / f) for f in FAMILIES]
    outs = run_ranks(["main", root, bad, *dirs], root, timeout=120)
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"rank {r} failed ({rc}):\n{out}\n{err[-3000:]}"
    res = {(f, r): json.loads((root / f"{f}.rank{r}.json").read_text()) for f in FAMILIES for r in (0, 1)}
    logits = {(f, r): np.load(root / f"{f}.rank{r}.npy") for f in FAMILIES for r in (0, 1)}
    return dict(root=root, out=[o for _, o, _ in outs], res=res, logits=logits)


def _unsplittable_model():
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs.from_dict(unsplittable_config()))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one_process(launched, family):
    """Greedy tokens under continuous batching, and logits, match one process."""
    want_tokens, want_logits = single_process(launched["root"] / family)
    for r in (0, 1):
        res = launched["res"][family, r]
        assert res["rank"] == r and res["size"] == 2 and res["primary"] == (r == 0) and res["sharded_size"] == 2
        assert res["reshard_noop"], "a sharded model must not be sharded again"
        assert res["tokens"] == want_tokens, f"rank {r} differs from the single-process run"
        assert res["steady_tokens"] == want_tokens
        got = launched["logits"][family, r]
        assert got.shape == want_logits.shape
        assert np.abs(got - want_logits).max() < LOGITS_ATOL
    assert np.array_equal(launched["logits"][family, 0], launched["logits"][family, 1])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_runs_the_lean_forward_as_the_sharded_model_computes(launched, family):
    """The lean forward serves the sharded model: each rank runs its shard on
    MLX's ops layers (the layer kernels add o/down into the residual stream,
    where the all-sum must go between), and its logits equal the model's own
    sharded forward bit for bit (the single-process comparison is above)."""
    for r in (0, 1):
        res = launched["res"][family, r]
        assert res["forward"]["lean"] and res["forward"]["layers"] == "mlx-ops", res["forward"]
        assert "sharded" in res["forward"]["native_off"], res["forward"]
        assert res["own_forward_equal"], f"rank {r}: the lean logits differ from the model's own sharded forward"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_keeps_the_compiled_step_guarantees(launched, family):
    full = tiny_model(family).layers[0].self_attn.n_kv_heads
    for r in (0, 1):
        res = launched["res"][family, r]
        assert set(res["kv_heads"]) == {full // 2}, "caches must be sized from the local KV heads"
        assert res["traces"] and all(n == 1 for n in res["traces"].values()), res["traces"]
        assert res["steady"] == "ok"
        assert res["in_place_growth"] < 0.25, "the sharded step copied its KV buffers"
    assert launched["res"][family, 0]["traces"] == launched["res"][family, 1]["traces"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_agrees_across_ranks(launched, family):
    a, b = launched["res"][family, 0], launched["res"][family, 1]
    assert a["seeded"] == b["seeded"] and a["unseeded"] == b["unseeded"]
    assert a["checks"] == b["checks"] > 0


def test_ranks_that_diverge_fail_loudly(launched):
    from mlx_tracer.runtime.distributed import DEFAULT_CHECK_EVERY

    for r in (0, 1):
        diverged = launched["res"][FAMILIES[-1], r]["diverged"]
        assert diverged and diverged["error"].startswith("ranks disagree on their requests or generated tokens"), diverged
        assert diverged["steps"] <= 2 * DEFAULT_CHECK_EVERY  # a check is read one period after it is dispatched


def test_only_the_primary_rank_prints(launched):
    lines = [line.split(":")[0] for line in launched["out"][0].splitlines() if line.startswith("PRIMARY")]
    assert lines == [f"PRIMARY {f}" for f in FAMILIES]
    assert launched["out"][1] == ""


def test_mlx_launch_starts_two_ranks(tmp_path):
    """The documented command: ``mlx.launch --backend ring -n 2 python ...``."""
    model_dir = write_model_dir(tiny_model("llama"), _config("llama"), tmp_path / "llama")
    launch = str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launch, "--backend", "ring", "-n", "2", "--starting-port", str(free_port_pair()), "--",
           sys.executable, RANK, "generate", tmp_path, model_dir]
    [(rc, out, err)] = run_group([list(map(str, cmd))], tmp_path / "logs", timeout=60)
    # (mlx.launch exits 0 even when a rank fails: the output is the check)
    want = Generator(tiny_model("llama"), IdTokenizer()).batch_generate([[1, 2, 3]], max_tokens=6)[0].tokens
    assert out.splitlines() == [f"PRIMARY {want}"], f"{out}\n{err[-3000:]}"


def test_unsplittable_model_fails_clearly_on_every_rank(launched):
    for r in (0, 1):
        err = launched["res"]["llama", r]["bad_error"]
        assert err.startswith("ValueError: llama.Model cannot be split across 2 ranks"), err
        assert "9 attention heads, 3 KV heads do not divide by 2" in err and "(1, 3)" in err


# --------------------------------------------------------- failing peers
def test_a_rank_that_dies_ends_the_other_with_an_error(tmp_path):
    model_dir = write_model_dir(tiny_model("llama"), _config("llama"), tmp_path / "llama")
    # a long step timeout: the ring backend itself usually notices (within ~0.5 s)
    # and raises; now and then (about 1 run in 15 here) MLX's ring logs "Failing
    # pending tasks" but leaves the collective waiting, and then the watchdog ends
    # the rank. Either way it exits with an error, never hangs.
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, _) = run_ranks(["die", tmp_path, model_dir], tmp_path, 60, dict(RANK_TEST_TIMEOUT="20"))
    assert rc1 == 3
    raised = rc0 == 1 and "DistributedError" in err0 and "another rank probably died" in err0
    watched = rc0 == -9 and "a peer rank is stuck, unreachable or never started" in err0
    assert raised or watched, (rc0, err0[-2000:])
    assert time.monotonic() - t0 < 60


def test_a_stuck_rank_trips_the_watchdog(tmp_path):
    """A peer that stops answering leaves rank 0 blocked inside a collective:
    the watchdog kills it after the step timeout (2 s here)."""
    model_dir = write_model_dir(tiny_model("llama"), _config("llama"), tmp_path / "llama")
    (rc0, _, err0), (rc1, _, _) = run_ranks(["hang", tmp_path, model_dir], tmp_path, 60, dict(RANK_TEST_TIMEOUT="2"),
                                            wait_for=[0])
    assert rc0 == -signal.SIGKILL, err0[-2000:]
    stuck = re.search(r"rank 0/2: decode step (\d+) made no progress for 2 s: a peer rank is stuck", err0)
    assert stuck and int(stuck.group(1)) > 5, err0[-2000:]  # the step where rank 1 stopped, not a slow early one
    assert rc1 is None  # the stuck one was still there: run_ranks ended it


def test_a_peer_that_never_connects_trips_the_watchdog(tmp_path):
    hostfile = tmp_path / "hosts.json"
    port = free_port_pair()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    code = "from mlx_tracer.runtime.distributed import init_group; init_group()"
    env = dict(MLX_RANK="0", MLX_HOSTFILE=str(hostfile), MLX_TRACER_STEP_TIMEOUT="2")
    [(rc, _, err)] = run_group([[sys.executable, "-c", code]], tmp_path / "logs", timeout=30, envs=[env])
    assert rc == -signal.SIGKILL and "rank 0: starting the distributed group" in err


# ------------------------------------------------------------- in-process
def test_models_without_shard_or_with_odd_heads_are_refused_before_any_work():
    with pytest.raises(ValueError, match=r"gemma3_text.Model has no shard\(\)"):
        check_shardable(tiny_model("gemma3_text"), 2)
    odd = _unsplittable_model()
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads do not divide by 2"):
        check_shardable(odd, 2)
    check_shardable(odd, 3)
    check_shardable(tiny_model("qwen3"), 2)


@pytest.mark.model
def test_smollm2_cannot_be_split_by_two():
    from mlx_tracer.api import load
    from mlx_tracer.loading.store import resolve_model

    from .helpers import model_present

    if not model_present():
        pytest.skip("SmolLM2 GGUF not present: run `mlx-tracer fetch` (or ./dev setup)")
    model = load(resolve_model(), weights="as-is")[0]
    with pytest.raises(ValueError, match=r"cannot be split across 2 ranks: 9 attention heads, 3 KV heads do not divide by 2; "
                                         r"run with a number of ranks that divides them \(1, 3\)"):
        check_shardable(model, 2)
    check_shardable(model, 3)  # 4-bit groups of o_proj and down_proj split by 3 too


def test_a_single_process_group_runs_unsharded():
    """distributed= with a group of one (no launcher) shards nothing and runs as usual."""
    model = tiny_model("llama")
    gen = Generator(model, IdTokenizer(), distributed=mx.distributed.init())
    assert gen.is_primary and gen.world_size == 1 and sharded_size(model) == 1
    want = Generator(tiny_model("llama"), IdTokenizer()).batch_generate([[1, 2, 3]], max_tokens=6)[0].tokens
    assert gen.batch_generate([[1, 2, 3]], max_tokens=6)[0].tokens == want
    assert gen.lockstep.checks >= 1
    assert shard_model(model, mx.distributed.init()) is model
    assert rank0_text(mx.distributed.init(), "float32-blocks") == "float32-blocks"


def test_watchdog_kills_only_when_a_guarded_region_overruns():
    victim = subprocess.Popen(["sleep", "30"])
    dog = Watchdog(0.5, rank="0/2", pid=victim.pid)
    try:
        with dog.guard("a fast step"):
            time.sleep(0.05)
        time.sleep(1.0)
        assert victim.poll() is None
        with dog.guard("a slow step"):
            assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait()
        dog.close()


def test_the_cli_runs_sharded_and_only_rank_0_prints(tmp_path):
    """``mlx-tracer generate --distributed`` on 2 ranks (started with the
    variables mlx.launch sets): rank 0 prints what one process prints, rank 1 nothing."""
    from .helpers import CLI

    model_dir = write_model_dir(tiny_model("llama"), _config("llama"), tmp_path / "llama")
    args = ["generate", "1 2 3", "--model", str(model_dir), "--weights", "as-is", "--no-chat", "--max-tokens", "6"]
    solo = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    assert solo.returncode == 0, solo.stderr
    port = free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    envs = [dict(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), MLX_TRACER_BLAS_THREADS="1") for r in (0, 1)]
    (rc0, out0, err0), (rc1, out1, err1) = run_group([[CLI, *args, "--distributed"]] * 2, tmp_path / "logs", 120, envs)
    assert rc0 == 0 and rc1 == 0, f"{err0[-2000:]}\n{err1[-2000:]}"
    assert out0 == solo.stdout and out0.strip()
    assert out1 == "" and "sharded over 2 ranks" in err0 and err1 == ""
