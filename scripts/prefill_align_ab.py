"""A/B of the upload alignment on the prefill step (llama-1b, triton, prefill graphs): the same engine
runs 32- and 2048-token prefills with metadata views 128-byte aligned and at packed (odd) offsets."""

import time

import torch

import tscompile
import tscompile.utils as utils
from tscompile import SamplingParams

llm = tscompile.LLM("llama-1b", attention_backend="triton", max_num_seqs=4, max_model_len=2064,
                    compile_options={"decode_ladder": (1,)})


def measure(n: int, iters: int = 20) -> float:
    prompt = [(7 * j) % 30000 + 3 for j in range(n)]
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        req = llm.add_request(prompt, SamplingParams(max_new_tokens=1))
        while not req.finished:
            llm.step()
        llm.sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


for align in (128, 1, 128, 1):
    utils.UPLOAD_ALIGN_BYTES = align
    print(f"align {align:4d} B: prefill 32 tok {measure(32):.3f} ms, 2048 tok {measure(2048):.3f} ms", flush=True)
