"""``mlx-tracer serve --distributed``: one server over a model sharded on 2
ranks (ring backend, 127.0.0.1), driven by the real ``openai`` client.

The main run is the documented command, ``mlx.launch --backend ring -n 2 --
mlx-tracer serve --distributed ...`` (its stdin a pipe that stays open: on an
exhausted stdin mlx.launch's I/O loop spins). Concurrent streamed and whole
requests, greedy and sampled with a seed, must answer what a single-process
server answers; a cancelled stream frees its row on both ranks; an idle
server outlives the step timeout without polling; SIGTERM on rank 0 drains
and stops both ranks cleanly. The lost-rank run starts the ranks directly
with the variables mlx.launch sets (mlx.launch would kill the survivor and
hide how it ends, see tests/test_distributed.py): rank 1 is killed under an
open stream, and rank 0 must end it with an error event and ``[DONE]``, then
exit 1 naming rank 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlx_tracer import Generator

from .helpers import CLI
from .serve_helpers import metrics, running_server, save_chat_model_dir, wait_for
from .test_distributed import free_port_pair

STEP_TIMEOUT = "4"  # s: MLX_TRACER_STEP_TIMEOUT of the ranks (an idle server must outlive it)
SERVE = ["serve", "--distributed", "--weights", "as-is", "--buckets", "1,2,4", "--port", "0"]
ENV = dict(MLX_TRACER_BLAS="0", MLX_TRACER_BLAS_THREADS="1", MLX_TRACER_STEP_TIMEOUT=STEP_TIMEOUT)
# (endpoint, stream, parameters): greedy and seeded sampling, chat and text, streamed and whole
REQUESTS = [
    ("chat", True, dict(messages=[{"role": "user", "content": "5 6 7"}], max_tokens=12, temperature=0)),
    ("chat", False, dict(messages=[{"role": "user", "content": "8 9"}], max_tokens=10, temperature=0)),
    ("completion", True, dict(prompt="5 6", max_tokens=12, temperature=0.9, seed=11)),
    ("completion", False, dict(prompt="3 4 5", max_tokens=12, temperature=0.8, top_p=0.9, seed=5)),
    ("chat", True, dict(messages=[{"role": "user", "content": "10 11"}], max_tokens=9, temperature=1.0, seed=3)),
]


def ask(url: str, endpoint: str, stream: bool, params: dict) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    r = create(model="tiny", stream=stream, **params)
    if endpoint == "chat":
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
    return "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text


def ask_all(url: str) -> list:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # all at once: they share the running batch
        return list(pool.map(lambda r: ask(url, *r), REQUESTS))


class Log:
    """A process's stderr, written to a file, read as it grows."""

    def __init__(self, path: Path):
        self.path = path

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def wait_for(self, pattern: str, proc, timeout: float = 60.0) -> re.Match:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            m = re.search(pattern, self.text())
            if m:
                return m
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the log:\n{self.text()[-3000:]}")


def start(cmd, log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True, env=dict(os.environ, **ENV, **env))


def kill_group(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model_dir(tmp_path_factory.mktemp("dist_serve") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir):
    """What a single-process server answers to REQUESTS."""
    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1, 2, 4))
    with running_server(gen) as (url, _):
        return ask_all(url)


def test_mlx_launch_serves_a_sharded_model_like_one_process(model_dir, reference, tmp_path):
    launch = str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launch, "--backend", "ring", "-n", "2", "--starting-port", str(free_port_pair()), "--",
           CLI, *SERVE, "--model", str(model_dir)]
    log = Log(tmp_path / "launch.err")
    proc = start(cmd, log.path, {})
    try:
        m = log.wait_for(r"serving tiny at (http://127\.0\.0\.1:\d+)/v1 .*rank 0 of 2, pid (\d+)", proc)
        url, pid0 = m.group(1), int(m.group(2))
        pid1 = int(log.wait_for(r"rank 1/2: following rank 0 .*pid (\d+)", proc).group(1))

        # idle past the step timeout: no watchdog kill, no polling in the collective
        cpu0, t0 = cpu_seconds(pid1), time.monotonic()
        time.sleep(float(STEP_TIMEOUT) + 0.5)
        idle_cpu = (cpu_seconds(pid1) - cpu0) / (time.monotonic() - t0)
        assert idle_cpu < 0.1, f"rank 1 used {idle_cpu:.0%} of a core while the server was idle"

        assert ask_all(url) == reference

        # a stream whose client leaves: its row is freed on rank 0 (and on rank 1: its exit line below)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="21 22", max_tokens=5000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for _, _ in zip(range(3), stream):
            pass
        stream.close()
        wait_for(lambda: metrics(url).get('mlx_tracer_requests_finished_total{reason="cancelled"}', 0) == 1
                 and metrics(url)["mlx_tracer_live_rows"] == 0, what="the cancelled row to be freed")
        assert ask_all(url) == reference  # the ranks still agree

        # SIGTERM to rank 0 with a stream open: it finishes, then both ranks stop cleanly
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=dict(prompt="21 22", max_tokens=40, temperature=0, ignore_eos=True,
                                                                     stream=True, stream_options={"include_usage": True}),
                          timeout=60) as r:
            for line in r.iter_lines():
                if line and not chunks:
                    os.kill(pid0, signal.SIGTERM)
                if line:
                    chunks.append(line)
        assert chunks[-1] == "data: [DONE]", chunks[-3:]
        assert json.loads(chunks[-2][6:])["usage"]["completion_tokens"] == 40  # every token: drained, not cut
        assert proc.wait(30) == 0
    finally:
        kill_group(proc)
    out = log.text()
    assert "SIGTERM: taking no new requests; 1 running" in out
    done = re.search(r"rank 1/2: stopped by rank 0 after (\d+) steps, (\d+) requests \((\d+) cancelled\), (\d+) rows live", out)
    assert done, out[-3000:]
    assert int(done.group(1)) > 0 and int(done.group(2)) == 2 * len(REQUESTS) + 2 and done.group(3, 4) == ("1", "0")
    # mlx.launch warns of a rank that failed (it exits 0 either way); errors and tracebacks have no place here
    for bad in ("exited with code", "was killed", "error", "Traceback", "made no progress"):
        assert bad not in out, out[-3000:]


def test_a_lost_rank_ends_the_server_with_an_error(model_dir, tmp_path):
    port = free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    logs = [Log(tmp_path / f"rank{r}.err") for r in (0, 1)]
    procs = [start([CLI, *SERVE, "--model", str(model_dir)], logs[r].path, dict(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)))
             for r in (0, 1)]
    try:
        url = logs[0].wait_for(r"serving tiny at (http://127\.0\.0\.1:\d+)/v1", procs[0]).group(1)
        lines, t_kill = [], None
        with httpx.stream("POST", url + "/v1/completions", json=dict(prompt="21 22", max_tokens=20000, temperature=0,
                                                                     ignore_eos=True, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 5:
                    procs[1].kill()
                    t_kill = time.monotonic()
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-3:]
        assert procs[0].wait(30) == 1
        assert time.monotonic() - t_kill < float(STEP_TIMEOUT) + 8
    finally:
        for p in procs:
            kill_group(p)
    err = logs[0].text()
    last = [line for line in err.splitlines() if line.startswith("mlx-tracer: error:")]
    assert last and "the sharded server stopped: rank 0/2:" in last[-1] and "lost rank 1" in last[-1], err[-3000:]
    assert "Traceback" not in err


def test_a_leader_serves_like_the_generator_and_beats_while_idle(model_dir, reference):
    """In process, on a group of one rank: the worker driven through a Leader
    answers what it answers without one, and steps every beat while idle."""
    import mlx.core as mx

    from mlx_tracer.api import load
    from mlx_tracer.serve.ranks import HEARTBEAT_S, Leader

    model, tokenizer = load(model_dir, weights="as-is")
    leader = Leader(Generator(model, tokenizer, buckets=(1, 2, 4), distributed=mx.distributed.init()))
    with running_server(leader) as (url, worker):
        assert ask_all(url) == reference
        sent = leader.sent
        time.sleep(5 * HEARTBEAT_S)
        assert leader.sent - sent >= 3 and worker.running
    with pytest.raises(ValueError, match="sharded Generator"):
        Leader(Generator(model, tokenizer))


@pytest.mark.parametrize("failure", ["group", "other"])
def test_an_engine_thread_whose_group_failed_waits_on_no_stream(model_dir, monkeypatch, failure):
    """When a collective raises (a peer died), MLX may still hold another that
    never ends (the lockstep's checksum, dispatched ahead): the engine thread
    must not wait on its streams then (``mx.synchronize`` would hang, and
    ``mlx-tracer serve`` exits at once on ``group_failed``). Any other failure
    still lets the thread's streams go before it ends."""
    import mlx.core as mx

    from mlx_tracer.runtime.distributed import DistributedError

    gen = Generator.load(model_dir, progress=False, weights="as-is", buckets=(1,))
    error = DistributedError("rank 0/2: a step failed; lost rank 1") if failure == "group" else RuntimeError("a bug")

    def step():
        raise error

    synced = []
    monkeypatch.setattr(gen, "step", step)
    monkeypatch.setattr(mx, "synchronize", lambda *a: synced.append(1))
    with running_server(gen) as (url, worker):
        r = httpx.post(url + "/v1/completions", json=dict(prompt="1 2", max_tokens=4), timeout=30)
        assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"], r.text
        wait_for(lambda: not worker._thread.is_alive(), what="the engine thread to end")
        assert worker.error is error and worker.group_failed == (failure == "group")
        assert synced == ([] if failure == "group" else [1])
