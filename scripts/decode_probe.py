"""Decode ms/step with a host-phase breakdown, and prefill ms/step with a host profile, on the GPU
(one engine, so one compile; full figures: `tscompile bench`)."""
import collections, cProfile, functools, io, pstats, sys, time
import torch
import tscompile
from tscompile import SamplingParams
from tscompile.counters import counters

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


def kernel_table(fn, label, reps=10):
    """GPU kernels of ``fn`` (graph-internal ones too): per-call count, summed time, the top 20."""
    from tscompile.bench.kernel_table import kernel_times
    per = kernel_times(fn, reps)
    count, total = sum(c for c, _ in per.values()), sum(t for _, t in per.values())
    print(f"{label}: {count:.0f} kernels per call, {total / 1e3:.3f} ms summed kernel time", flush=True)
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"  {t:8.1f} us  x{c:5.0f}  {name[:110]}", flush=True)


model = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,32").split(",")]
t0 = time.perf_counter()
llm = tscompile.LLM(model, attention_backend="triton", max_num_seqs=64, max_model_len=4096, page_size=16,
                    compile_options={"decode_ladder": (1, 2, 4, 8, 16, 32, 64)})
print(f"engine up in {time.perf_counter() - t0:.1f} s (compile {llm.compile_seconds:.1f} s, "
      f"capture {llm.capture_seconds:.1f} s)", flush=True)
timed(llm.scheduler, "schedule", "schedule"); timed(llm.scheduler, "update", "update")
timed(llm.runner.staging, "fill", "fill"); timed(llm.runner.staging, "upload", "upload")
timed(llm.attention, "refresh_decode_metadata", "refresh"); timed(llm.runner.graphs, "replay_graph", "replay")
for bs in sizes:
    reqs = [llm.add_request([(i * 31 + j) % 1000 + 1 for j in range(512)], SamplingParams(max_new_tokens=128))
            for i in range(bs)]
    while any(r.num_generated == 0 for r in reqs):
        llm.step()
    phases.clear()
    n = 0
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while llm.scheduler.running:  # decode steps only; the last tokens are read back below
        llm.step(); n += 1
    llm.sync()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    g = llm.runner.graphs.graphs[llm.runner.graphs.decode_key(llm.runner.decode.padded_size(bs), True)].graph
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record(); torch.cuda.synchronize()
    br = ", ".join(f"{k} {v / n * 1e6:.0f}us" for k, v in phases.items())
    kernel_table(lambda: g.replay(), f"{model} bs={bs} graph replay")
    print(f"{model} bs={bs}: decode {dt * 1e3:.3f} ms/step over {n} steps (graph alone "
          f"{s.elapsed_time(e) / 20:.3f} ms; host {br})", flush=True)
    if bs == sizes[0]:
        prof = cProfile.Profile()
        llm.add_request([5] * 64, SamplingParams(max_new_tokens=40))
        llm.step()
        prof.enable()
        for _ in range(30):
            llm.step()
        prof.disable()
        while llm.has_unfinished():
            llm.step()
        out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print("decode host profile (30 steps):", out.getvalue()[-3000:], flush=True)

# Prefill: one request of n tokens, max_new_tokens=1; the first call at a size captures its graphs.
for n_tok in (32, 2048):
    times = []
    for it in range(6):
        c0 = counters["prefill_captures"]
        llm.add_request([(j * 7) % 1000 + 1 for j in range(n_tok)], SamplingParams(max_new_tokens=1))
        torch.cuda.synchronize(); t0 = time.perf_counter()
        if it == 5:
            prof = cProfile.Profile(); prof.enable()
        if it == 4:
            kernel_table(llm.step, f"{model} prefill {n_tok} tokens, one step", reps=1)
        else:
            llm.step()
        torch.cuda.synchronize()
        if it == 5:
            prof.disable()
        times.append((time.perf_counter() - t0, counters["prefill_captures"] - c0))
        while llm.has_unfinished():
            llm.step()
    steady = [t for t, c in times[1:] if c == 0]
    print(f"{model} prefill {n_tok} tokens: {min(steady) * 1e3:.3f} ms/step; all (ms, captures): "
          f"{[(round(t * 1e3, 2), c) for t, c in times]}; graphed steps {counters['prefill_graphed']}", flush=True)
    out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print(out.getvalue()[-3000:], flush=True)
