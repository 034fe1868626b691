"""Tensor parallelism without processes: the split of a model over ranks, sharded checkpoint loading
(only the rank's slices are read), the refusals, and that one rank keeps the one-device model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tscompile
from tscompile.models import ModelConfig, Transformer, build_config, load_checkpoint
from tscompile.models import checkpoint as checkpoint_module
from tscompile.models.parallel import (ParallelLMHead, RowParallelLinear, ShardLayout, TensorParallel,
                                       VocabParallelEmbedding, check_tensor_parallel)

transformers = pytest.importorskip("transformers")

# vocabulary 301: not a multiple of 2 or 4, so the last rank's embedding and head carry a padding row
TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)


def _checkpoint(path, config_cls: str, model_cls: str, seed: int, **extra):
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**TINY, **extra)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    hf.save_pretrained(path, max_shard_size="100KB")  # several shards: slices cross files
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "llama": _checkpoint(tmp_path_factory.mktemp("llama"), "LlamaConfig", "LlamaForCausalLM", 0,
                             num_key_value_heads=2, tie_word_embeddings=False),
        "qwen3-tied": _checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3Config", "Qwen3ForCausalLM", 1,
                                  num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("heads,kv,size", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (4, 4, 4), (4, 2, 4)])
def test_every_query_head_of_a_rank_reads_a_kv_head_of_that_rank(heads, kv, size):
    cfg = ModelConfig(n_heads=heads, n_kv_heads=kv, dim=64 * heads // 4 if heads != 4 else 64)
    group = heads // kv
    holders = {h: set() for h in range(kv)}
    for rank in range(size):
        layout = ShardLayout(cfg, rank, size)
        assert len(layout.q_heads) == heads // size
        assert len(layout.kv_heads) == max(kv // size, 1)
        for h in layout.q_heads:
            assert h // group in layout.kv_heads  # GQA: query head h reads KV head h // group
        for k in layout.kv_heads:
            holders[k].add(rank)
    assert all(len(r) == max(size // kv, 1) for r in holders.values())  # replicated size / kv times
    assert sorted(h for r in range(size) for h in ShardLayout(cfg, r, size).q_heads) == list(range(heads))


class _SliceSpy:
    """Records every read through safetensors' ``safe_open``: whole tensors and slices."""

    def __init__(self, monkeypatch):
        self.whole: list[str] = []
        self.slices: dict[str, tuple] = {}
        real = checkpoint_module.safe_open
        spy = self

        class Opened:
            def __init__(self, *args, **kwargs):
                self._ctx = real(*args, **kwargs)

            def __enter__(self):
                self._f = self._ctx.__enter__()
                return self

            def __exit__(self, *exc):
                return self._ctx.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_tensor(self, name):
                spy.whole.append(name)
                return self._f.get_tensor(name)

            def get_slice(self, name):
                stored = self._f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return stored.get_shape()

                    def get_dtype(self):
                        return stored.get_dtype()

                    def __getitem__(self, index):
                        spy.slices[name] = index
                        return stored[index]
                return Slice()

        monkeypatch.setattr(checkpoint_module, "safe_open", Opened)


@pytest.mark.parametrize("family", ["llama", "qwen3-tied"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_loads_only_its_slices_and_they_equal_the_split_of_the_whole_model(checkpoints, family, size,
                                                                                  monkeypatch):
    path = checkpoints[family]
    full, _ = load_checkpoint(path, device="cpu")
    full_params = dict(full.named_parameters())
    total = sum(p.numel() * 4 for p in full_params.values())
    for rank in range(size):
        spy = _SliceSpy(monkeypatch)
        tp = TensorParallel(rank, size, group_name="unused")  # loading runs no collective
        shard, info = load_checkpoint(path, device="cpu", tp=tp)
        layout = ShardLayout(full.config, rank, size)
        assert shard.config == layout.local_config()
        # every sharded tensor was read as a slice, never whole; only norms are read whole
        assert spy.whole and all("norm" in name for name in spy.whole), spy.whole
        q_rows = layout.q_rows
        assert spy.slices["model.layers.1.self_attn.q_proj.weight"] == slice(q_rows.start, q_rows.stop)
        o_index = spy.slices["model.layers.0.self_attn.o_proj.weight"]
        assert o_index[1] == slice(q_rows.start, q_rows.stop)
        assert info.bytes_read < total / size + total / 4  # a share plus the replicated norms and KV heads
        for name, p in shard.named_parameters():
            expected = layout.shard(name, full_params[name].detach())
            assert p.shape == expected.shape, name
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)
        padding = layout.vocab_per_rank - len(layout.vocab_rows)
        assert padding == (layout.vocab_per_rank * size - 301 if rank == size - 1 else 0)
        if padding:
            assert shard.output.weight[-padding:].abs().sum() == 0
        if full.config.tie_embeddings:
            assert shard.output.weight is shard.tok_embeddings.weight


def test_random_weights_of_a_rank_are_its_split_of_the_one_device_model():
    cfg = build_config("llama-tiny", vocab_size=301)
    full = dict(tscompile.models.build_model(cfg, seed=3).named_parameters())
    for rank in range(2):
        layout = ShardLayout(cfg, rank, 2)
        shard = tscompile.models.build_model(cfg, seed=3, tp=TensorParallel(rank, 2, "unused"))
        for name, p in shard.named_parameters():
            torch.testing.assert_close(p.detach(), layout.shard(name, full[name].detach()), rtol=0, atol=0)


def test_one_rank_keeps_the_plain_layers():
    model = tscompile.models.build_model("llama-tiny")
    assert model.tp is None and model.full_config == model.config
    block = model.layers[0]
    plain = [model.tok_embeddings, model.output, block.attention.wqkv, block.attention.wo, block.feed_forward.w13,
             block.feed_forward.w2]
    assert [type(m) for m in plain] == [nn.Embedding] + [nn.Linear] * 5
    shard = Transformer(build_config("llama-tiny"), TensorParallel(0, 2, "unused"))
    assert isinstance(shard.layers[0].attention.wo, RowParallelLinear)
    assert isinstance(shard.tok_embeddings, VocabParallelEmbedding) and isinstance(shard.output, ParallelLMHead)


@pytest.mark.parametrize("size,match", [
    (3, "must divide the model's 4 query heads; sizes this model splits into: \\[1, 2, 4\\]"),
    (8, "must divide the model's 4 query heads"),
])
def test_splits_the_model_cannot_take_are_refused(size, match):
    with pytest.raises(ValueError, match=f"^tscompile: tensor_parallel_size {size} {match}"):
        check_tensor_parallel(build_config("llama-tiny"), size)
    with pytest.raises(ValueError, match="^tscompile: tensor_parallel_size"):
        tscompile.LLM("llama-tiny", device="cpu", enforce_eager=True, tensor_parallel_size=size)


def test_kv_heads_and_mlp_width_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="must divide the model's 6 KV heads or be a multiple of them"):
        check_tensor_parallel(ModelConfig(dim=768, n_heads=12, n_kv_heads=6), 4)
    with pytest.raises(ValueError, match="must divide the MLP width 510"):
        check_tensor_parallel(ModelConfig(intermediate_size=510), 4)
    with pytest.raises(ValueError, match="narrowing model"):
        check_tensor_parallel(build_config("narrow-tiny"), 2)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2"])
def test_tensor_parallel_size_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"^tscompile: tensor_parallel_size must be an int >= 1, got"):
        tscompile.LLM("llama-tiny", device="cpu", enforce_eager=True, tensor_parallel_size=value)


def test_a_built_model_is_refused_with_tensor_parallelism():
    model = tscompile.models.build_model("llama-tiny")
    with pytest.raises(ValueError, match="^tscompile: tensor_parallel_size 2 needs a preset name, a ModelConfig or a "
                                         "checkpoint directory"):
        tscompile.LLM(model, device="cpu", enforce_eager=True, tensor_parallel_size=2)
