"""formats.json heals, and the re-measure rule of the ``auto`` weight format
(tracer/loading/format_cache.py, tracer/loading/weights.py). A tiny quantized
llama stands in for a model; decode timings are faked where the test needs
to decide which format wins."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_tracer.cli import main
from mlx_tracer.loading import format_cache, weights
from mlx_tracer.loading.format_cache import FormatChoice, Setup

from .tiny_models import tiny_model


@pytest.fixture
def home(monkeypatch, tmp_path):
    from mlx_tracer.backend import kernels

    kernels.load()  # from the real cache folder, once a process (info's status line would build them in this one)
    monkeypatch.setenv("MLX_TRACER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF stand-in")
    return p


def quantized():
    m = tiny_model("llama")
    nn.quantize(m, group_size=32, bits=4)
    mx.eval(m.parameters())
    return m


def fake_timings(monkeypatch, ms):
    """decode_step_ms returns ``ms[format]`` per batch row; returns the call log."""
    calls = []

    def step_ms(model, B, **_):
        fmt = "as-is" if weights.is_quantized(model) else "float32"
        calls.append((fmt, B))
        return ms[fmt] * B

    monkeypatch.setattr(weights, "decode_step_ms", step_ms)
    monkeypatch.setattr(weights, "quantized_candidates", lambda: ())  # two candidates (see the quantized tests below)
    return calls


def choose(source, log=lambda s: None):
    return weights.choose_format(quantized(), source, quantized, log)[1]


def valid_entry(source, **over) -> dict:
    e = FormatChoice(Setup.of(source), "as-is", {"as-is": {1: 5.0, 4: 9.0}, "float32": {1: 6.0, 4: 8.0}}, 0.1, 1.0).to_json()
    e.update(over)
    return e


@pytest.mark.parametrize(
    "content",
    ["[]", "null", "42", '"text"', "{not json", "", '{"version": 2, "entries": {}}',
     '{"/old/key|1|2|mlx 0.32.4|libblas.so|2": {"format": "as-is", "ms": {}}}'],
)
def test_a_formats_file_of_the_wrong_shape_is_rebuilt(home, source, content, monkeypatch, capfd):
    (home / "formats.json").write_text(content)
    assert format_cache.list_choices() == []
    assert "rebuilt it with the valid entries" in capfd.readouterr().err
    assert json.loads((home / "formats.json").read_text()) == {"version": 2, "entries": []}
    fake_timings(monkeypatch, {"as-is": 10.0, "float32": 5.0})
    assert choose(source) == "float32"  # measured again and recorded
    assert [c.format for c in format_cache.list_choices()] == ["float32"]


@pytest.mark.parametrize(
    "bad",
    [{"format": None}, {"format": "auto"}, {"timings": {}}, {"timings": {"float32": {"1": 3.0}}},
     {"timings": {"as-is": {"1": -1.0}}}, {"timings": {"as-is": {"0": 1.0}}}, {"size": "12"},
     {"load_avg": "busy"}, {"cores": True}],
)
def test_entries_that_do_not_validate_are_dropped_the_rest_kept(home, source, bad):
    broken = valid_entry(source, model="/elsewhere/other.gguf", **bad)
    del_format = {k: v for k, v in valid_entry(source, model="/x.gguf").items() if k != "format"}
    good = valid_entry(source)
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": [broken, del_format, good]}))
    choices = format_cache.list_choices()
    assert [c.setup.model for c in choices] == [good["model"]]
    assert json.loads((home / "formats.json").read_text())["entries"] == [good]


def test_info_and_auto_load_survive_a_broken_formats_file(home, source, monkeypatch, capsys):
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": [{"model": "m"}, None]}))
    monkeypatch.setattr("mlx_tracer.bench.Machine.measure", classmethod(lambda cls, sizes_mb=(1, 256): cls({mb << 20: 1.0 for mb in sizes_mb}, 1.0)))
    assert main(["info"]) == 0
    assert "weights      auto not measured yet" in capsys.readouterr().out
    fake_timings(monkeypatch, {"as-is": 10.0, "float32": 20.0})
    assert choose(source) == "as-is"


def test_choices_record_their_load_average_and_a_busy_one_is_measured_again_when_quiet(home, source, monkeypatch):
    cores = Setup.of(source).cores
    calls = fake_timings(monkeypatch, {"as-is": 10.0, "float32": 5.0})
    monkeypatch.setattr(weights, "current_load", lambda: cores + 3.0)  # busy
    assert choose(source) == "float32" and len(calls) == 4
    (busy,) = format_cache.list_choices()
    assert busy.load_avg == cores + 3.0 and busy.measured_busy and busy.measured_at > 0
    # still busy: the provisional choice is used, nothing is timed
    assert choose(source) == "float32" and len(calls) == 4
    # quiet now: measured again (as-is wins this time) and replaced
    monkeypatch.setattr(weights, "current_load", lambda: cores / 4)
    fake_timings(monkeypatch, {"as-is": 10.0, "float32": 30.0})
    said = []
    assert choose(source, said.append) == "as-is"
    assert any("measuring weight formats again" in s for s in said)
    (quiet,) = format_cache.list_choices()
    assert quiet.format == "as-is" and quiet.load_avg == cores / 4 and not quiet.measured_busy
    # a quiet measurement stands, busy or not
    calls = fake_timings(monkeypatch, {"as-is": 10.0, "float32": 1.0})
    for load in (0.0, cores + 10.0):
        monkeypatch.setattr(weights, "current_load", lambda load=load: load)
        assert choose(source) == "as-is"
    assert calls == []


def test_an_entry_without_a_load_average_counts_as_busy(home, source, monkeypatch):
    entry = valid_entry(source, format="float32", load_avg=None)
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": [entry]}))
    (c,) = format_cache.list_choices()
    assert c.measured_busy
    assert weights.should_remeasure(c, 0.5) and not weights.should_remeasure(c, None)


def test_a_write_drops_entries_that_can_never_apply_again(home, source, tmp_path):
    """A model file that is gone, or a BLAS shim build the cache folder no
    longer has (pruned), leaves an entry no setup can match: the next write
    drops it; other MLX versions' and BLAS libraries' entries stay."""
    (home / "blas-shim-present.so").write_bytes(b"shim")
    gone_model = valid_entry(source, model=str(tmp_path / "deleted.gguf"))
    gone_shim = valid_entry(source, blas="blas-shim-pruned.so")
    other_mlx = valid_entry(source, mlx="0.0.1")
    kept_shim = valid_entry(source, blas="blas-shim-present.so")
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": [gone_model, gone_shim, other_mlx, kept_shim]}))
    assert len(format_cache.list_choices()) == 4  # reading drops nothing
    new = FormatChoice.from_json(valid_entry(source, cores=999))
    assert format_cache.record(new)
    entries = json.loads((home / "formats.json").read_text())["entries"]
    assert entries == [other_mlx, kept_shim, new.to_json()]


def test_info_shows_the_entries_that_apply_here_and_counts_the_rest(home, source, monkeypatch, capsys):
    monkeypatch.setattr("mlx_tracer.bench.Machine.measure", classmethod(lambda cls, sizes_mb=(1, 256): cls({mb << 20: 1.0 for mb in sizes_mb}, 1.0)))
    here = valid_entry(source)
    others = [valid_entry(source, mlx="0.0.1"), valid_entry(source, blas="libother.so"), valid_entry(source, cores=999)]
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": [here, *others]}))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("weights")]
    assert len(lines) == 1 and f"[mlx {here['mlx']}|{here['blas']}|{here['cores']} cores]" in lines[0]
    assert "3 more in" in out and "not used here" in out
    (home / "formats.json").write_text(json.dumps({"version": 2, "entries": others}))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto not measured yet for this MLX/BLAS/core count" in out and "3 more in" in out


def test_the_rule_prefers_the_faster_of_the_block_formats_and_float32_only_by_a_margin():
    t = lambda ms: {1: ms, 4: 4 * ms}  # noqa: E731  (ms per step at batch 1 and 4)
    assert weights.pick_format({"as-is": t(10), "quantized": t(4), "float32": t(5)}) == "quantized"
    assert weights.pick_format({"as-is": t(10), "quantized": t(5.4), "float32": t(5)}) == "quantized"  # not 10 % faster
    assert weights.pick_format({"as-is": t(10), "quantized": t(8), "float32": t(5)}) == "float32"
    assert weights.pick_format({"as-is": t(5), "quantized": t(5), "float32": t(9)}) == "as-is"  # a tie keeps as-is
    assert weights.pick_format({"as-is": t(10), "float32": t(5)}) == "float32"
    three = {"as-is": t(10), "quantized-factored": t(6), "quantized-split": t(4), "float32": t(4.2)}
    assert weights.pick_format(three) == "quantized-split"  # the fastest block format; float32 not 10 % faster


def test_a_stored_choice_that_did_not_time_the_quantized_format_is_measured_again(home, source, monkeypatch):
    calls = fake_timings(monkeypatch, {"as-is": 10.0, "float32": 5.0})
    monkeypatch.setattr(weights, "current_load", lambda: 0.0)
    assert choose(source) == "float32" and len(calls) == 4
    assert choose(source) == "float32" and len(calls) == 4  # stored: not timed again
    monkeypatch.setattr(weights, "quantized_candidates", lambda: ("quantized",))  # the kernels are built now
    logs = []
    choose(source, logs.append)
    assert len(calls) == 10 and "did not time quantized" in " ".join(logs)
    assert "quantized" in format_cache.list_choices()[0].timings
    # a later version's candidate (quantized-factored where qmm runs on AVX2) is timed again too
    monkeypatch.setattr(weights, "quantized_candidates", lambda: ("quantized-factored",))
    logs = []
    choose(source, logs.append)
    assert len(calls) == 16 and "did not time quantized-factored" in " ".join(logs)
    assert "quantized-factored" in format_cache.list_choices()[0].timings
    # and 0.5.15's second one (quantized-split): every candidate timed, the one missing named
    monkeypatch.setattr(weights, "quantized_candidates", lambda: ("quantized-factored", "quantized-split"))
    logs = []
    choose(source, logs.append)
    assert len(calls) == 24 and "did not time quantized-split" in " ".join(logs)
    assert {"quantized-factored", "quantized-split"} <= set(format_cache.list_choices()[0].timings)
    choose(source)
    assert len(calls) == 24  # stored with both: not timed again
