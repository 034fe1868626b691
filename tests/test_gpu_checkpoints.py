"""Checkpoints on the GPU: the 1B and 8B presets' random weights written by transformers'
``save_pretrained`` load back into the same tokens, transformers' bf16 logits agree, and the load
speed is reported (``TSCOMPILE_REPORT_DIR`` collects it as JSON). Skipped without CUDA."""

import json
import os

import pytest
import torch

import tscompile
from tscompile import SamplingParams
from tscompile.models.hf_save import save_hf_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_alone]  # an 8B model in two engines and transformers

PROMPTS = [[(13 * i + 7 * j) % 30000 + 5 for j in range(17 + 11 * i)] for i in range(4)]


def _engine(model, **kw):
    return tscompile.LLM(model, enforce_eager=True, device="cuda", dtype=torch.bfloat16, max_model_len=256,
                         max_num_seqs=4, page_size=16, attention_backend="triton", **kw)


def _prefill_logits(llm, prompt):
    seen = []
    hook = llm.model.output.register_forward_hook(lambda m, a, out: seen.append(out.float().clone()))
    try:
        llm.generate([prompt], SamplingParams(max_new_tokens=1))
    finally:
        hook.remove()
    return seen[0][0]


def _report(name: str, value: dict) -> None:
    folder = os.environ.get("TSCOMPILE_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(value, f, indent=1)


@pytest.mark.parametrize("preset", ["llama-1b", pytest.param("llama-8b", marks=pytest.mark.slow)])
def test_a_checkpoint_saved_by_transformers_gives_the_presets_tokens(preset, tmp_path):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reference = _engine(preset)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]
    hf = save_hf_checkpoint(reference.model, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() or preset == "llama-1b"

    loaded = _engine(str(tmp_path))
    info = loaded.parts.checkpoint
    got = [o.outputs[0].token_ids for o in loaded.generate(PROMPTS, params)]
    assert got == expected
    # bf16 logits against transformers: both are judged by their distance to transformers' float32
    # forward of the same weights, so bf16 rounding over 16-32 random layers is not mistaken for a bug
    ours = _prefill_logits(loaded, PROMPTS[1])
    ids = torch.tensor([PROMPTS[1]], device="cuda")
    with torch.no_grad():
        theirs = hf(ids).logits[0, -1].float()
        reference = hf.float()(ids).logits[0, -1]
    rel_ours = float((ours - reference).norm() / reference.norm())
    rel_theirs = float((theirs - reference).norm() / reference.norm())
    assert rel_ours <= 2 * rel_theirs + 1e-3, (rel_ours, rel_theirs)
    _report(f"checkpoint_{preset}", {"gb": info.bytes_read / 1e9, "load_seconds": info.load_seconds,
                                     "gb_per_s": info.gb_per_s, "logits_rel_l2_vs_fp32": rel_ours,
                                     "transformers_bf16_rel_l2_vs_fp32": rel_theirs,
                                     "top1_equal_transformers_bf16": int(ours.argmax()) == int(theirs.argmax())})
    print(f"{preset}: loaded {info.bytes_read / 1e9:.1f} GB in {info.load_seconds:.2f} s "
          f"({info.gb_per_s:.2f} GB/s); logits rel L2 vs float32: ours {rel_ours:.2e}, transformers bf16 "
          f"{rel_theirs:.2e}")
