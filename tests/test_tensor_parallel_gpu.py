"""Tensor parallelism on CUDA: NCCL collectives inside the compiled steps and their CUDA graphs, and
sharded loading onto the GPU. The engine tests need two GPUs and skip otherwise."""

from __future__ import annotations

import pytest
import torch

import tscompile
from tscompile import SamplingParams
from tscompile.models import load_checkpoint
from tscompile.models.parallel import ShardLayout, TensorParallel

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices")

PROMPTS = [[17, 4], [5, 250, 3, 99, 42], list(range(7, 40)), [(i * 37) % 300 for i in range(70)]]
TINY = dict(vocab_size=301, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, num_key_value_heads=1,
                                                                tie_word_embeddings=False)).eval()
    with torch.no_grad():  # O(1)-scale weights: sharp logits, no near-ties between the splits' sum orders
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape)
            p.copy_(1 + 0.3 * r if "norm" in name else r if "embed" in name else r / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, max_shard_size="200KB")
    return str(path)


def _tokens(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    return [o.outputs[0].token_ids for o in outs]


@two_gpus
@pytest.mark.parametrize("compiled", [False, True])
def test_two_gpus_give_the_one_gpu_tokens(checkpoint, compiled):
    """Compiled: the decode ladder's CUDA graphs and the prefill graphs capture the NCCL all-reduces and
    the logits' all-gather (a replicated KV head: the checkpoint has one)."""
    kw = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4, num_pages=64,
              enforce_eager=not compiled, compile_options=None if not compiled else {"decode_ladder": [1, 2, 4]})
    reference = _tokens(tscompile.LLM(checkpoint, **kw))
    llm = tscompile.LLM(checkpoint, tensor_parallel_size=2, **kw)
    try:
        assert _tokens(llm) == reference
        assert _tokens(llm) == reference  # the captured graphs replayed
        if compiled:
            assert llm.runner.graphs is not None and llm.capture_seconds > 0
    finally:
        llm.close()


def test_a_rank_loads_its_shard_straight_onto_the_gpu(checkpoint):
    full, _ = load_checkpoint(checkpoint, device="cuda", dtype=torch.float32)
    full_params = dict(full.named_parameters())
    for rank in range(2):
        shard, _ = load_checkpoint(checkpoint, device="cuda", dtype=torch.float32, tp=TensorParallel(rank, 2, "unused"))
        layout = ShardLayout(full.config, rank, 2)
        for name, p in shard.named_parameters():
            assert p.device.type == "cuda"
            torch.testing.assert_close(p.detach(), layout.shard(name, full_params[name].detach()), rtol=0, atol=0)
