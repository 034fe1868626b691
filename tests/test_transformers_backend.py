"""The transformers backend (``model_impl="transformers"``): a checkpoint's own modeling code on the
paged engine gives transformers' greedy tokens, token for token in float32, and a feature the paged
kernels cannot honour is refused at load time.

Tiny random checkpoints are written by transformers' ``save_pretrained``, once per module; weights are
redrawn at O(1) scale (as in test_checkpoints.py) so attention is sharp and a wrong row, position,
scale or cache page changes the tokens.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import tscompile
from tscompile.models import Transformer
from tscompile.models.hf_transformers import TransformersModel
from helpers import ids, record_built_models, save_tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=330, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NEW_TOKENS = 8
# mixed lengths: a one-token prompt, short ones, and one past two pages of 4
PROMPTS = [[17], [5, 250, 3, 99, 42], list(range(7, 20)), [(i * 37) % 300 + 3 for i in range(23)]]

# architecture -> (config class, model class, config extras); the first four have no native model
ARCHS = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # untied: Gemma scales the embedding by sqrt(hidden), which a tied head turns into "repeat the input"
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    # Granite's multipliers: attention scaling apart from head_dim ** -0.5, scaled embeddings/residuals/logits
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.09, embedding_multiplier=2.0,
                                                             residual_multiplier=0.7, logits_scaling=1.5)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}
NON_NATIVE = ["phi3", "olmo2", "gemma", "granite"]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.5 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


def _write(arch: str | tuple, path: Path, seed: int, **changes):
    config_cls, model_cls, extra = ARCHS[arch] if isinstance(arch, str) else arch
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**TINY, **extra, **changes})).eval()
    _randomize(hf, seed)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # both sides run the full length
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint directory, the transformers model it holds)."""
    out = {}
    for seed, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, _write(arch, path, seed))
    return out


@torch.no_grad()
def hf_greedy(hf, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    device = next(hf.parameters()).device
    x = torch.tensor([prompt], device=device)
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def engine(path, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 4)
    return tscompile.LLM(str(path), device="cpu", attention_backend="torch", page_size=4, **kw)


def generate(llm, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    params = tscompile.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params))


def assert_varied(tokens: list[list[int]]) -> None:
    """Greedy tokens that say something: not one repeated token for every prompt."""
    assert len({t for row in tokens for t in row}) > len(tokens) + 2, tokens


# -- the same tokens as transformers --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", NON_NATIVE)
def test_auto_runs_a_non_native_architecture_with_transformers_tokens(checkpoints, arch):
    path, hf = checkpoints[arch]
    llm = engine(path)  # model_impl="auto": no native model for these
    assert isinstance(llm.model, TransformersModel)
    got = generate(llm, PROMPTS)
    assert got == [hf_greedy(hf, p) for p in PROMPTS]
    assert_varied(got)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_and_transformers_implementations_both_give_transformers_tokens(checkpoints, arch):
    path, hf = checkpoints[arch]
    want = [hf_greedy(hf, p) for p in PROMPTS]
    native, auto, through_hf = engine(path, model_impl="native"), engine(path), engine(path, model_impl="transformers")
    assert isinstance(native.model, Transformer) and isinstance(auto.model, Transformer)
    assert isinstance(through_hf.model, TransformersModel)
    assert generate(native, PROMPTS) == generate(through_hf, PROMPTS) == want
    assert_varied(want)


def test_chunked_prefill_and_preemption_keep_transformers_tokens(checkpoints):
    """Prompts split over steps of 8 tokens, and a pool too small for all four requests at once."""
    path, hf = checkpoints["olmo2"]
    prompts = [PROMPTS[3], PROMPTS[2], [(i * 11) % 300 + 5 for i in range(19)], PROMPTS[1]]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    chunked = engine(path, max_num_batched_tokens=8)
    assert generate(chunked, prompts, 12) == want
    small = engine(path, num_pages=20)  # 19 usable pages of 4 tokens: under the 24 the four requests reach
    assert generate(small, prompts, 12) == want
    assert small.scheduler.num_preemptions > 0


def test_requests_one_at_a_time_equal_the_batch(checkpoints):
    path, hf = checkpoints["granite"]
    llm = engine(path)
    want = [hf_greedy(hf, p) for p in PROMPTS]
    assert generate(llm, PROMPTS) == want
    assert [generate(llm, [p])[0] for p in PROMPTS[2:]] == want[2:]


def test_compiled_engine_gives_transformers_tokens(checkpoints):
    """Decode compiled whole and prefill piecewise (split at the attention op), as for a native
    model; Phi3's fused qkv and gate/up projections run through the compiled pieces. The pieces run
    as Dynamo traced them (``piece_compiler="eager"``: Inductor's CPU build took minutes here); the
    GPU test below compiles them with Inductor."""
    from torch._dynamo.utils import counters as dynamo_counters

    from tscompile.counters import counters

    path, hf = checkpoints["phi3"]
    breaks_before, graph_breaks_before = counters["breaks"], sum(dynamo_counters["graph_break"].values())
    llm = engine(path, enforce_eager=False, compile_options={"piece_compiler": "eager"})
    assert generate(llm, PROMPTS[:3]) == [hf_greedy(hf, p) for p in PROMPTS[:3]]
    # the modeling code traces whole (no Dynamo graph break), and the prefill step is split at
    # each layer's attention op, as a native model's
    assert sum(dynamo_counters["graph_break"].values()) == graph_breaks_before
    assert counters["breaks"] - breaks_before == TINY["num_hidden_layers"]


def test_text_prompts_use_the_checkpoints_tokenizer(checkpoints, tmp_path):
    path, hf = checkpoints["phi3"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    save_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) <= TINY["vocab_size"]
    llm = engine(tmp_path)
    text = "Hello world! The quick"
    out = llm.generate([text], tscompile.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    want = hf_greedy(hf, tok(text).input_ids)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == tok.decode(want)


# -- what the engine cannot honour is refused at load time ------------------------------------------------------

def _config_edit(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


def test_attention_soft_capping_is_refused(tmp_path):
    _write(("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=4096)), tmp_path, 0,
           attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match=r"^tscompile: Gemma2ForCausalLM .*soft-capping"):
        engine(tmp_path)


def test_a_short_sliding_window_is_refused_and_a_long_one_runs(checkpoints, tmp_path):
    path, hf = checkpoints["phi3"]
    windowed = _config_edit(path, tmp_path / "w", sliding_window=16)
    with pytest.raises(ValueError, match=r"^tscompile: Phi3ForCausalLM .*sliding-window .*window 16.*"
                                         r"max_model_len <= 16"):
        engine(windowed, max_model_len=64)
    # a window as long as any sequence masks nothing: transformers' windowed model gives these tokens
    hf_windowed = transformers.AutoModelForCausalLM.from_pretrained(windowed).eval()
    hf_windowed.generation_config.eos_token_id = None
    prompts = [PROMPTS[1], PROMPTS[2]]
    assert generate(engine(windowed, max_model_len=16), prompts, 3) == [hf_greedy(hf_windowed, p, 3) for p in prompts]


def test_data_dependent_rope_is_refused(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    raw = json.loads((path / "config.json").read_text())
    rope = {**(raw.get("rope_parameters") or {"rope_theta": 10000.0}), "rope_type": "dynamic", "factor": 2.0}
    edited = _config_edit(path, tmp_path, rope_parameters=rope)
    with pytest.raises(ValueError, match=r"^tscompile: LlamaForCausalLM .*RoPE type 'dynamic'"):
        engine(edited, model_impl="transformers")


def test_a_model_that_numbers_its_tokens_itself_is_refused(checkpoints, monkeypatch):
    """A model whose positions come from the sequence, not ``position_ids``, would number packed
    rows of several requests as one sequence: simulated by a Llama whose RoPE ignores them."""
    from transformers.models.llama import modeling_llama

    rope_forward = modeling_llama.LlamaRotaryEmbedding.forward

    def sequence_positions(self, x, position_ids, *args, **kwargs):
        counted = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
        return rope_forward(self, x, counted, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", sequence_positions)
    with pytest.raises(ValueError, match=r"^tscompile: LlamaForCausalLM .*does not depend on position_ids"):
        engine(checkpoints["llama"][0], model_impl="transformers")


def test_remote_code_is_refused(checkpoints, tmp_path):
    edited = _config_edit(checkpoints["phi3"][0], tmp_path, auto_map={"AutoModelForCausalLM": "x.Y"})
    with pytest.raises(ValueError, match=r"^tscompile: Phi3ForCausalLM .*trust_remote_code"):
        engine(edited)


KIMI_LINEAR = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_head_dim=16,
                   linear_num_heads=4, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                   num_key_value_heads=4, layer_types=["linear_attention", "full_attention"],
                   mlp_layer_types=["dense", "dense"])


@pytest.mark.skipif(not hasattr(transformers, "KimiLinearConfig"), reason="this transformers has no Kimi Linear")
def test_kimi_linear_is_refused_for_its_delta_layers_then_for_its_latent_attention(tmp_path):
    """Kimi Linear (docs/transformers_backend.md says what it would need): its Kimi Delta Attention
    layers keep their state in transformers' cache, which the backend does not run; with those
    layers made full attention, its MLA layers' keys (nope + rope) and values differ in size."""
    _write(("KimiLinearConfig", "KimiLinearForCausalLM", KIMI_LINEAR), tmp_path / "kimi", 0)
    with pytest.raises(ValueError, match=r"^tscompile: KimiLinearForCausalLM cannot run on the transformers "
                                         r"backend: it has 'linear_attention' layers"):
        engine(tmp_path / "kimi")
    attention_only = _config_edit(tmp_path / "kimi", tmp_path / "mla", layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match=r"^tscompile: KimiLinearForCausalLM .*value head_dim 16 != key head_dim 24"):
        engine(attention_only, model_impl="transformers")


def test_model_impl_values_are_checked(checkpoints):
    with pytest.raises(ValueError, match=r"^tscompile: model_impl must be one of"):
        engine(checkpoints["phi3"][0], model_impl="hf")
    with pytest.raises(ValueError, match=r"^tscompile: model_impl='transformers' needs a checkpoint directory"):
        tscompile.LLM("llama-tiny", model_impl="transformers", device="cpu")
    with pytest.raises(ValueError, match=r"^tscompile: checkpoint architecture \['Phi3ForCausalLM'\]"):
        engine(checkpoints["phi3"][0], model_impl="native")


def test_old_transformers_is_refused(checkpoints, monkeypatch):
    # the module the backend imports now (an earlier test may have re-imported transformers)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.50.3")
    with pytest.raises(ValueError, match=r"^tscompile: model_impl='transformers' needs transformers >= 4.51"):
        engine(checkpoints["phi3"][0])


# -- the command line -----------------------------------------------------------------------------------------

def test_generate_cli_takes_model_impl(checkpoints, capsys):
    from tscompile.cli import main

    path, hf = checkpoints["llama"]
    prompt = PROMPTS[2]
    argv = ["generate", "--model", str(path), "--device", "cpu", "--attention-backend", "torch", "--enforce-eager",
            "--max-model-len", "64", "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", "6",
            "--ignore-eos", "--json"]
    assert main(argv + ["--model-impl", "transformers"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["outputs"][0]["token_ids"] == hf_greedy(hf, prompt, 6)
    assert main(["generate", "--model", "llama-tiny", "--device", "cpu", "--model-impl", "transformers",
                 "--prompt-ids", "1 2"]) == 2
    assert "needs a checkpoint directory" in capsys.readouterr().err


def test_bench_model_impl_transformers_runs_the_presets_weights_through_transformers(tmp_path, monkeypatch):
    """``tscompile bench --model-impl transformers`` on a preset: the engine mode loads a transformers
    checkpoint of the same seeded weights, so it decodes the native float32 reference's tokens."""
    from tscompile.cli import main

    built = record_built_models(monkeypatch)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "2", "--input-len", "8",
            "--output-len", "4", "--prefill-lens", "8", "--num-iters", "1", "--modes", "eager", "--model-impl",
            "transformers", "--output-json", str(out_json), "--no-progress", "--bandwidth-mib", "16"]
    assert main(argv) == 0
    result = json.loads(out_json.read_text())
    assert result["args"]["model_impl"] == "transformers"
    assert built and all(isinstance(m, TransformersModel) for m in built)
    rows = result["results"]
    assert rows and all(r["error"] is None for r in rows), rows
    # agrees on the tokens, and (an engine mode) on their float32 log-probabilities
    assert all(r["reference_check"]["agrees"] is True and r["reference_check"]["compared_tokens"] == 4
               and r["reference_check"]["max_logprob_diff"] < 1e-4 for r in rows), rows


# -- GPU: graphs on --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_graphs_on_give_transformers_tokens(checkpoints):
    """OLMo-2 on CUDA in float32 with decode CUDA graphs per bucket and prefill graphs: the greedy
    tokens of transformers' float32 generate on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, hf = checkpoints["olmo2"]
    llm = tscompile.LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="torch", page_size=16,
                        max_model_len=128, max_num_seqs=8, compile_options={"decode_ladder": (1, 2, 4, 8)})
    assert llm.runner.graphs is not None and llm.runner.graphs.decode_ladder == (1, 2, 4, 8)
    prompts = PROMPTS + [[(i * 13) % 300 + 4 for i in range(40)]]
    hf = copy.deepcopy(hf).to("cuda")
    want = [hf_greedy(hf, p, 16) for p in prompts]
    assert generate(llm, prompts, 16) == want
    assert [generate(llm, [p], 16)[0] for p in prompts[:2]] == want[:2]  # bs=1 decode graph
