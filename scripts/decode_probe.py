"""Decode ms/step probe on the GPU with a host-phase breakdown (full figures: `tscompile bench`)."""
import collections, functools, sys, time, torch, tscompile
from tscompile import SamplingParams

phases = collections.defaultdict(float)


def timed(obj, name, label):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[label] += time.perf_counter() - t
    setattr(obj, name, wrap)


model = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
for bs in [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,32").split(",")]:
    llm = tscompile.LLM(model, attention_backend="triton", max_num_seqs=64, max_model_len=1024, page_size=16,
                        compile_options={"decode_ladder": (1, 2, 4, 8, 16, 32, 64)})
    t0 = time.perf_counter()
    reqs = [llm.add_request([(i * 31 + j) % 1000 + 1 for j in range(512)], SamplingParams(max_new_tokens=128)) for i in range(bs)]
    while any(not r.output for r in reqs):
        llm.step()
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    phases.clear()
    timed(llm.scheduler, "schedule", "schedule"); timed(llm.scheduler, "update", "update")
    timed(llm.runner.staging, "fill", "fill"); timed(llm.runner.staging, "upload", "upload")
    timed(llm.backend, "refresh_decode_metadata", "refresh"); timed(llm.runner.decode_graphs, "replay", "replay")
    n = 0
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while llm.has_unfinished():
        llm.step(); n += 1
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    g = llm.runner.decode_graphs.graphs[(llm.runner.decode_bucket(bs), True)]
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record(); torch.cuda.synchronize()
    gpu_ms = s.elapsed_time(e) / 20
    br = ", ".join(f"{k} {v / n * 1e6:.0f}us" for k, v in phases.items())
    print(f"{model} bs={bs}: decode {dt*1e3:.3f} ms/step over {n} steps (graph alone {gpu_ms:.3f} ms; host {br}); "
          f"ttft {ttft*1e3:.0f} ms, compile {llm.compile_seconds:.1f} s, capture {llm.capture_seconds:.1f} s", flush=True)
    del llm, g; torch.cuda.empty_cache()

# Prefill: ms per 32- and 2048-token single-request step, and where the host time of one goes.
import cProfile, pstats, io
llm = tscompile.LLM(model, attention_backend="triton", max_num_seqs=64, max_model_len=4096, page_size=16,
                    compile_options={"decode_ladder": (1,)})
for n_tok in (32, 2048):
    times = []
    for it in range(6):
        llm.add_request([(j * 7) % 1000 + 1 for j in range(n_tok)], SamplingParams(max_new_tokens=1))
        torch.cuda.synchronize(); t0 = time.perf_counter()
        if it == 5:
            prof = cProfile.Profile(); prof.enable()
        llm.step()
        torch.cuda.synchronize()
        if it == 5:
            prof.disable()
        times.append(time.perf_counter() - t0)
        while llm.has_unfinished():
            llm.step()
    print(f"{model} prefill {n_tok} tokens: {min(times[2:]) * 1e3:.3f} ms/step (all: {[round(t * 1e3, 2) for t in times]})")
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-3500:])
