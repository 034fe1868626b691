"""Write a checkpoint of random weights in a real model's shape, with transformers' own classes, for
the float32 token checks of a family that has no preset (``tscompile bench --model DIR --dtype float32``).

    python scripts/write_random_checkpoint.py qwen3-0.6b /tmp/qwen3-0.6b-shape

The weights are transformers' initialisation under ``torch.manual_seed(--seed)``, written with
``save_pretrained`` (float32 safetensors and config.json; no tokenizer: token ids only). ``--layers``
and ``--vocab-size`` shrink a shape for a quick run.
"""

from __future__ import annotations

import argparse

import torch

# The shapes of the published configs (hidden sizes, heads, norms, RoPE), as transformers' config kwargs.
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def write(shape: str, out: str, seed: int = 0, layers: int | None = None, vocab_size: int | None = None,
          device: str = "cpu") -> None:
    import transformers

    config_cls, model_cls, kwargs = SHAPES[shape]
    kwargs = dict(kwargs)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    model.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", help="the checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape's")
    p.add_argument("--vocab-size", type=int, help="a smaller vocabulary than the shape's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where transformers initialises the weights (faster on cuda)")
    a = p.parse_args(argv)
    write(a.shape, a.out, a.seed, a.layers, a.vocab_size, a.device)
    print(f"wrote {a.shape} (random weights, seed {a.seed}) to {a.out}")


if __name__ == "__main__":
    main()
