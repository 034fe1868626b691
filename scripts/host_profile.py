"""Host work of one bs=1 prefill through the whole-step path, with the model taken out.

    TRITON_INTERPRET=1 python scripts/host_profile.py [prompt_len] [iterations] [--decode N] [--sort KEY]

Runs on the CPU: llama-tiny, float32, whole-step prefill in host-replay mode (the same padding,
metadata and staging as on CUDA, the step run over the persistent buffers), warmed up, then with the
step itself replaced by a no-op so only tscompile's host work remains: admitting the request,
scheduling, the step plan, the metadata arrays, staging them, the sampled token's read-back and the
request's end. Prints the milliseconds per ``generate`` of one prompt to one token, then a cProfile of
the same loop by cumulative time (the profiler itself roughly doubles the times).

``--decode N``: each prompt generates N tokens (eos ignored), with the decode step and its metadata
refresh kernel no-ops too; the line printed adds the host work per decode step (the difference to
one-token generates, over N - 1 steps), and the profile covers those generates. ``--sort tottime``
orders the profile by own time.

The token ladder reaches the prompt's bucket (16, 32, 64 for the default 32 tokens; up to 512 for
512), so every prompt up to the vocabulary's 512 ids runs as one whole-step graph."""
import argparse
import cProfile
import pstats
import time

import torch

import tscompile
import tscompile.attention.base
from tscompile.runtime.graph_runner import HostGraphs


def _ladder(prompt_len: int) -> tuple[int, ...]:
    """16, 32, 64 and on, doubling, up to the first entry that holds the prompt."""
    ladder = [16, 32, 64]
    while ladder[-1] < prompt_len:
        ladder.append(2 * ladder[-1])
    return tuple(ladder)


def _timed(llm, prompts, params, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        llm.generate(prompts, params)
    return (time.perf_counter() - start) / iterations * 1e3


def main(prompt_len: int = 32, iterations: int = 200, decode: int = 0, sort: str = "cumtime") -> None:
    ladder = _ladder(prompt_len)
    new_tokens = max(decode, 1)
    llm = tscompile.LLM("llama-tiny", device="cpu", dtype=torch.float32,
                        max_model_len=max(128, prompt_len + new_tokens), max_num_seqs=4, page_size=16,
                        max_num_batched_tokens=ladder[-1],
                        compile_options={"token_ladder": ladder, "prefill_graph_max_tokens": ladder[-1],
                                         "decode_ladder": (1, 2, 4)})
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="whole")
    one = tscompile.SamplingParams(max_new_tokens=1)
    params = tscompile.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    vocab = llm.model.config.vocab_size
    prompt = [i % (vocab - 1) + 1 for i in range(prompt_len)]
    for _ in range(3):  # compile and warm up with the model in place
        llm.generate([prompt], params)
    llm.runner.graphs.run = lambda key, step, **kw: None  # host work only from here on
    llm.runner.decode.run_compiled = lambda bs, greedy: None
    # the decode metadata refresh is one kernel launch on CUDA; here it would run Triton's interpreter
    tscompile.attention.base.run_refresh = lambda *args: None
    ms_one = _timed(llm, [prompt], one, iterations)
    print(f"host work per one-prompt generate: {ms_one:.3f} ms ({prompt_len} tokens, {iterations} iterations, "
          f"model excluded)")
    if decode > 1:
        ms = _timed(llm, [prompt], params, iterations)
        print(f"host work per generate of {decode} tokens: {ms:.3f} ms, per decode step "
              f"{(ms - ms_one) / (decode - 1):.3f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(iterations):
        llm.generate([prompt], params)
    profile.disable()
    pstats.Stats(profile).sort_stats(sort).print_stats(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt_len", type=int, nargs="?", default=32)
    parser.add_argument("iterations", type=int, nargs="?", default=200)
    parser.add_argument("--decode", type=int, default=0, metavar="N")
    parser.add_argument("--sort", default="cumtime", choices=("cumtime", "tottime"))
    args = parser.parse_args()
    main(args.prompt_len, args.iterations, args.decode, args.sort)
