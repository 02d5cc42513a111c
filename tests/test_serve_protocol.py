"""Request bodies -> GenerationSpec, without a server or a model."""

from __future__ import annotations

import pytest

from mlx_tracer.serve.errors import APIError
from mlx_tracer.serve.metrics import Histogram, ServerMetrics, parse
from mlx_tracer.serve.protocol import DEFAULT_MAX_TOKENS, parse_chat, parse_completion


def test_chat_fields_are_read_with_openai_defaults():
    spec = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                    {"role": "assistant", "content": None}]}, "m")
    assert spec.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                           {"role": "assistant", "content": ""}]
    assert spec.max_tokens == DEFAULT_MAX_TOKENS and spec.sampling.temperature == 1.0 and not spec.stream
    spec = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                       "max_completion_tokens": 5.0, "temperature": 0, "top_k": 3, "min_p": 0.1, "seed": 4,
                       "stop": "END", "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
                       "top_logprobs": 0, "n": 1, "user": "u", "ignore_eos": True}, "m")
    assert spec.max_tokens == 5 and spec.max_tokens_param == "max_completion_tokens"
    assert (spec.sampling.temperature, spec.sampling.top_k, spec.sampling.min_p, spec.sampling.seed) == (0.0, 3, 0.1, 4)
    assert spec.stop == ["END"] and spec.stream and spec.include_usage and spec.logprobs and spec.ignore_eos


def test_completion_prompts():
    assert parse_completion({"prompt": "hi"}, "m").prompt == "hi"
    assert parse_completion({"prompt": [[1, 2]]}, "m").prompt == [1, 2]
    assert parse_completion({"prompt": ["only one"]}, "m").prompt == "only one"
    assert parse_completion({"prompt": [3], "logprobs": 0}, "m").logprobs
    assert not parse_completion({"prompt": [3]}, "m").logprobs


@pytest.mark.parametrize("body, param", [
    ([1], None), ({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 1.5}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": [5]}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_bodies_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        parse_chat(body, "m")
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_metrics_render_in_prometheus_text_format():
    m = ServerMetrics()
    m.count_response("/v1/completions", 200)
    m.count_finished("stop")
    for s in (0.02, 0.3, 40.0):
        m.observe_ttft(s)
    out = parse(m.render())
    assert out['mlx_tracer_http_requests_total{path="/v1/completions",code="200"}'] == 1
    assert out['mlx_tracer_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert out['mlx_tracer_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert out["mlx_tracer_time_to_first_token_seconds_count"] == 3
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.5, 1.7, 3.0):
        h.observe(v)
    assert h.counts == [1, 2, 1] and h.count == 4
