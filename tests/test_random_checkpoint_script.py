"""scripts/write_random_checkpoint.py: a shrunken qwen3-0.6b shape written by transformers loads into
the engine, which decodes transformers' greedy tokens in float32."""

import importlib.util
from pathlib import Path

import pytest
import torch

import tscompile
from tscompile import SamplingParams

transformers = pytest.importorskip("transformers")
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "write_random_checkpoint.py"


def _script():
    spec = importlib.util.spec_from_file_location("write_random_checkpoint", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_shrunken_qwen3_shape_gives_transformers_greedy_tokens(tmp_path):
    _script().main(["qwen3-0.6b", str(tmp_path), "--layers", "2", "--vocab-size", "1000", "--device", "cpu"])
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.head_dim) == ("qwen3", 2, 1024, 128)
    prompt = [5, 17, 3, 99, 42, 7, 8, 250, 11]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    llm = tscompile.LLM(str(tmp_path), enforce_eager=True, device="cpu", dtype=torch.float32, max_model_len=64,
                        max_num_seqs=2)
    got = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert got == want
