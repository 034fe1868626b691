"""``tscompile.LLM(speculative_config=...)``: vLLM's keys accepted and parsed, and every setting the
engine cannot honour refused with a ``tscompile:`` message before any model loads."""

from __future__ import annotations

import json

import pytest
import torch

import tscompile
from tscompile.spec_decode import SpeculativeConfig
from tscompile.spec_decode.engine_checks import MAX_VERIFY_WIDTH, check_engine_speculation, vocab_size_without_loading
from tests.helpers import ids, small_llm


def _config_dir(path, vocab: int):
    """A checkpoint directory as far as the vocabulary check reads it (its config.json)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab}))
    return str(path)


@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": MAX_VERIFY_WIDTH}, f"num_speculative_tokens={MAX_VERIFY_WIDTH}"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}, "'disable_by_batch_size'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/no/such/draft"}, "'/no/such/draft'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_refused_before_the_model_loads(config, words, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr("tscompile.runtime.engine.build_model_engine", no_build)
    with pytest.raises(ValueError, match="^tscompile: ") as e:
        small_llm(speculative_config=config)
    assert words in str(e.value)


def test_draft_model_vocabulary_must_match_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr("tscompile.runtime.engine.build_model_engine",
                        lambda *a, **k: pytest.fail("the model was built before the refusal"))
    draft = _config_dir(tmp_path / "draft", 500)
    with pytest.raises(ValueError, match=r"^tscompile: .*vocabulary of 500 tokens, the target has 512"):
        small_llm(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": draft})
    target = _config_dir(tmp_path / "target", 777)
    with pytest.raises(ValueError, match=r"vocabulary of 500 tokens, the target has 777"):
        check_engine_speculation({"method": "draft_model", "num_speculative_tokens": 2, "model": draft},
                                 model=target, tensor_parallel_size=1)
    # a matching vocabulary passes, read from config.json, text_config too
    same = tmp_path / "same"
    same.mkdir()
    (same / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 777}}))
    assert vocab_size_without_loading(str(same)) == 777
    spec = check_engine_speculation({"method": "draft_model", "num_speculative_tokens": 2, "model": str(same)},
                                    model=target, tensor_parallel_size=1)
    assert spec.model == str(same) and spec.verify_width == 3


def test_speculation_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match=r"^tscompile: .*tensor_parallel_size=2"):
        check_engine_speculation({"method": "ngram", "num_speculative_tokens": 2}, model="llama-tiny",
                                 tensor_parallel_size=2)


def test_window_wider_than_the_graphs_is_refused():
    with pytest.raises(ValueError, match=r"^tscompile: .*num_speculative_tokens=4 needs verify windows of 5 rows"):
        check_engine_speculation({"method": "ngram", "num_speculative_tokens": 4}, model="llama-tiny",
                                 tensor_parallel_size=1, max_width=4)


def test_engine_parses_vllm_keys_and_refuses_min_tokens():
    torch.manual_seed(0)
    llm = small_llm(dtype=torch.float32, enforce_eager=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_min=3, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"^tscompile: min_tokens=2 cannot be honoured with speculative"):
        llm.add_request([1, 2, 3], tscompile.SamplingParams(min_tokens=2, max_new_tokens=4))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    params = tscompile.SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = small_llm(dtype=torch.float32, enforce_eager=True)
    assert ids(llm.generate([prompt], params)) == ids(plain.generate([prompt], params))
    assert small_llm(dtype=torch.float32, enforce_eager=True).speculative_config is None
