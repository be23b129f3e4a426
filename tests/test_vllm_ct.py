"""vllm_ct's reading of the parameter data's scheme keys."""

from __future__ import annotations

import pytest


def test_a_scheme_key_is_parsed_once_however_often_it_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4forge.checkpoint import vllm_ct, vllm_params

    parsed: list[str] = []
    real = vllm_params.scheme_args
    monkeypatch.setattr(vllm_params, "scheme_args", lambda key: parsed.append(key) or real(key))
    key = '{"method": "compressed-tensors", "weights": {"num_bits": 4}, "probe": "parsed-once"}'
    assert all(vllm_ct.is_ct_key(key) for _ in range(3)) and not vllm_ct.is_ct_key('{"method": "gptq", "probe": "parsed-once"}')
    assert parsed.count(key) == 1
