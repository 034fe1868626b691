"""Why did tests/test_gpu_graphs.py::test_default_prefill_graph_mode...[narrow-tiny-triton-False] see
other tokens than eager? The test compared a chunked compiled engine (max_num_batched_tokens=64)
with an unchunked eager one. Print the tokens of eager unchunked, eager chunked, compiled chunked,
for both attention backends, and at the first divergence the reference's top-2 logit margin."""
import torch

import tscompile
from tscompile import SamplingParams

PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
LADDER = {"decode_ladder": (1, 2, 4, 8), "token_ladder": (16, 32, 64), "prefill_graph_max_tokens": 64}


def make(backend, **kw):
    return tscompile.LLM("narrow-tiny", attention_backend=backend, device="cuda", dtype=torch.float32,
                         max_model_len=256, max_num_seqs=16, page_size=16, **kw)


def ids(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=4))]


for backend in ("triton", "torch"):
    runs = {"eager": ids(make(backend, enforce_eager=True)),
            "eager_mbt64": ids(make(backend, enforce_eager=True, max_num_batched_tokens=64)),
            "compiled_mbt64": ids(make(backend, compile_options=dict(LADDER), max_num_batched_tokens=64))}
    for name, toks in runs.items():
        print(backend, name, toks, flush=True)
    print(backend, "eager == eager_mbt64:", runs["eager"] == runs["eager_mbt64"],
          "compiled_mbt64 == eager_mbt64:", runs["compiled_mbt64"] == runs["eager_mbt64"], flush=True)
    # the margin: the unchunked eager run again, its LM head's rows per step (all four requests prefill
    # in step 0 and decode together after it, so row r of step s is request r's token s)
    llm = make(backend, enforce_eager=True)
    seen = []
    hook = llm.model.output.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))
    again = ids(llm)
    hook.remove()
    assert again == runs["eager"], "eager is not deterministic"
    for r, (a, b) in enumerate(zip(runs["eager"], runs["compiled_mbt64"])):
        if a == b:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        row = seen[step][r]
        top = row.topk(2)
        print(backend, f"request {r} step {step}: eager {a[step]} compiled {b[step]}, eager top-2 {top.indices.tolist()} "
              f"margin {float(top.values[0] - top.values[1]):.3e}, logit of the compiled token "
              f"{float(row[b[step]]):.5f} vs {float(top.values[0]):.5f}", flush=True)
