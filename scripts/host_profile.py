"""Host work of one bs=1 prefill through the whole-step path, with the model taken out.

    TRITON_INTERPRET=1 python scripts/host_profile.py [prompt_len] [iterations]

Runs on the CPU: llama-tiny, float32, whole-step prefill in host-replay mode (the same padding,
metadata and staging as on CUDA, the step run over the persistent buffers), warmed up, then with the
step itself replaced by a no-op so only tscompile's host work remains: admitting the request,
scheduling, the step plan, the metadata arrays, staging them, the sampled token's read-back and the
request's end. Prints the milliseconds per ``generate`` of one prompt to one token, then a cProfile of
the same loop by cumulative time (the profiler itself roughly doubles the times)."""
import cProfile
import pstats
import sys
import time

import torch

import tscompile

LADDER = {"token_ladder": (16, 32, 64), "prefill_graph_max_tokens": 64, "decode_ladder": (1, 2, 4)}


def main(prompt_len: int = 32, iterations: int = 200) -> None:
    llm = tscompile.LLM("llama-tiny", device="cpu", dtype=torch.float32, max_model_len=128, max_num_seqs=4,
                        page_size=16, max_num_batched_tokens=64, compile_options=LADDER)
    llm.runner.enable_whole_step_prefill(host_replay=True)
    params = tscompile.SamplingParams(max_new_tokens=1)
    prompt = list(range(1, prompt_len + 1))
    for _ in range(3):  # compile and warm up with the model in place
        llm.generate([prompt], params)
    llm.runner.whole_prefill.run = lambda key, step: None  # host work only from here on
    start = time.perf_counter()
    for _ in range(iterations):
        llm.generate([prompt], params)
    print(f"host work per one-prompt generate: {(time.perf_counter() - start) / iterations * 1e3:.3f} ms "
          f"({prompt_len} tokens, {iterations} iterations, model excluded)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(iterations):
        llm.generate([prompt], params)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
