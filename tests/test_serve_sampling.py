"""The server's sampling parameters, live on 127.0.0.1 with the official
``openai`` client: ``n`` choices (whole and streamed, chat and completions),
``top_logprobs`` in the shapes the client parses, and the penalties and
``logit_bias``, each equal to the Generator's own answer.

The reference answers are computed up front by a separate Generator on the
same model, before the server's engine thread runs (one thread uses MLX at a time).
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from mlx_tracer import Generator

from .serve_helpers import running_server, save_chat_model_dir

CHAT = [{"role": "user", "content": "5 6 7 5 6"}]
PENALISED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model_dir(tmp_path_factory.mktemp("serve_sampling") / "tiny")


@pytest.fixture(scope="module")
def refs(model_dir):
    """Completions of the reference Generator by name: (token ids, completion)."""
    gen = Generator.load(model_dir, progress=False, weights="as-is")
    ids = list(gen.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    out = {"ids": ids, "tok": gen.tokenizer}

    def run(name, **kw):
        uid = gen.submit(ids, chat=False, **kw)
        list(gen.events())
        out[name] = gen.result(uid)

    for i in range(3):
        run(f"seed{i}", max_tokens=6, temp=1.0, seed=5 + i)
    run("greedy", max_tokens=8, top_logprobs=3)
    run("plain", max_tokens=10)
    banned = out["plain"].tokens[0]
    out["banned"] = banned
    run("biased", max_tokens=10, logit_bias={banned: -100.0})
    run("penalised", max_tokens=10, **PENALISED)
    return out


@pytest.fixture(scope="module")
def server(model_dir, refs):
    gen = Generator.load(model_dir, progress=False, weights="as-is")
    with running_server(gen) as (url, worker):
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_n_choices_whole_and_streamed_with_top_logprobs(server, refs):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=1.0, seed=5, n=3,
                                  logprobs=True, top_logprobs=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [refs[f"seed{i}"].text for i in range(3)]  # choice i: seed + i
    assert r.usage.completion_tokens == sum(len(refs[f"seed{i}"].tokens) for i in range(3))
    assert r.usage.prompt_tokens == len(refs["ids"])
    for ch in r.choices:
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
                   for t in ch.logprobs.content)

    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=1.0, seed=5, n=3,
                                            stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], []
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.append(ch.index)
    assert texts == [refs[f"seed{i}"].text for i in range(3)] and sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    r = c.completions.create(model="tiny", prompt=refs["ids"], max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=2)
    assert [ch.text for ch in r.choices] == [refs["seed0"].text, refs["seed1"].text]
    top = r.choices[0].logprobs.top_logprobs
    assert len(top) == len(r.choices[0].logprobs.tokens) and all(1 <= len(d) <= 2 for d in top)


def test_top_logprobs_equal_the_generators_and_lead_with_the_greedy_pick(server, refs):
    ref, decode = refs["greedy"], refs["tok"].decode
    r = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                               top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [decode([t]) for t in ref.tokens]
    for t, alts in zip(content, ref.top_logprobs):
        assert [a.token for a in t.top_logprobs] == [decode([i]) for i, _ in alts]
        assert np.allclose([a.logprob for a in t.top_logprobs], [lp for _, lp in alts], atol=1e-5)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_penalties_and_logit_bias_over_the_wire(server, refs):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                  frequency_penalty=PENALISED["frequency_penalty"],
                                  presence_penalty=PENALISED["presence_penalty"],
                                  extra_body={"repetition_penalty": PENALISED["repetition_penalty"]})
    assert r.choices[0].message.content == refs["penalised"].text != refs["plain"].text
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                  logit_bias={str(refs["banned"]): -100})
    assert r.choices[0].message.content == refs["biased"].text != refs["plain"].text
    for kw, param in [(dict(n=9), "n"), (dict(logit_bias={"100000": 1}), "logit_bias"),
                      (dict(frequency_penalty=2.5), "frequency_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **kw)
        assert e.value.body["param"] == param, e.value.body
