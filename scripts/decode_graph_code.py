"""Inductor's code for the decode graphs of a 2-layer model of llama-8b's shapes, with each kernel's time.

    python3 scripts/decode_graph_code.py [BS ...]     # default 1 8 32; the code goes to stderr

Why: in the llama-8b kernel tables (bench/results/llama-8b-b964437/) the dynamic-batch decode graph
runs the query's RoPE as a kernel of 4.2 us per layer at bs 8-64 (the key's 1.6 us, the static bs=1
graph's both-in-one 1.6 us, the tuned static baseline's 1.8-2.1 us), and nothing on the CPU shows
why: the CUDA code exists only where a GPU compiles it. This prints every compiled graph's output
code (TORCH_LOGS=output_code, set before torch is imported) and then, per batch size, the replayed
decode graph's kernels with their time, so the slow kernel's source can be read beside its time.
Two layers keep the compile short; the per-layer kernels are the same as in the 32-layer model.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCH_LOGS", "output_code")

import dataclasses  # noqa: E402

import torch  # noqa: E402

import tscompile  # noqa: E402
from tscompile import SamplingParams  # noqa: E402
from tscompile.bench.kernel_table import kernel_times  # noqa: E402
from tscompile.models import build_config, build_model  # noqa: E402


def main(argv: list[str]) -> int:
    sizes = [int(x) for x in argv] or [1, 8, 32]
    cfg = dataclasses.replace(build_config("llama-8b"), n_layers=2)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    llm = tscompile.LLM(model, attention_backend="triton", max_num_seqs=max(sizes), max_model_len=2064,
                        page_size=16, compile_options={"decode_ladder": tuple(sorted(set(sizes)))})
    for bs in sizes:
        reqs = [llm.add_request([(i * 31 + j) % 1000 + 1 for j in range(512)], SamplingParams(max_new_tokens=64))
                for i in range(bs)]
        while any(r.num_generated < 8 for r in reqs):  # past the prefill, into graphed decode steps
            llm.step()
        graph = llm.runner.graphs.graphs[llm.runner.graphs.decode_key(llm.runner.decode.padded_size(bs), True)].graph
        per = kernel_times(lambda: graph.replay(), 20)
        total = sum(t for _, t in per.values())
        print(f"\n#### decode bs={bs}: {sum(c for c, _ in per.values()):.0f} kernels per replay, {total:.1f} us "
              f"(2 layers)", flush=True)
        for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:8.2f} us  x{count:4.0f}  {name[:150]}", flush=True)
        while llm.has_unfinished():
            llm.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
