#!/usr/bin/env bash
# Which AOTInductor load path works on this machine? Each case in its own process, faulthandler on.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/pkg"
cat > /tmp/lin.py <<'P'
import sys, torch
case = sys.argv[1]
dev = "cpu" if case == "cpu_pt2" else "cuda"
m = torch.nn.Linear(8, 8).to(dev); x = torch.randn(3, 8, device=dev)
ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))
if case == "public_api":
    p = torch._inductor.aoti_compile_and_package(ep, package_path="/tmp/pub.pt2")
    print("packaged", p, flush=True)
    r = torch._inductor.aoti_load_package(p)
elif case == "legacy_so":
    so = torch._inductor.aot_compile(ep.module(), (x,), {})
    print("compiled", so, flush=True)
    r = torch._export.aot_load(so, "cuda")
elif case == "runner_so":
    so = torch._inductor.aot_compile(ep.module(), (x,), {})
    print("compiled", so, flush=True)
    runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda")
    r = lambda t: runner.run([t])
else:
    from torch.export.pt2_archive._package import package_pt2, load_pt2
    f = torch._inductor.aot_compile(ep.module(), (x,), {}, options={"aot_inductor.package": True})
    p = f"/tmp/{case}.pt2"
    package_pt2(p, aoti_files={"model": f})
    print("packaged", flush=True)
    kw = {"run_single_threaded": True} if case == "single_threaded" else {}
    r = list(load_pt2(p, device_index=0 if dev == "cuda" else -1, **kw).aoti_runners.values())[0]
print("loaded", flush=True)
y = r(x)
y = y[0] if isinstance(y, (list, tuple)) else y
print(case, "OK max err", (y - m(x)).abs().max().item(), flush=True)
P
pids=()
for c in public_api legacy_so runner_so single_threaded cpu_pt2; do
  (timeout 240 python3 -X faulthandler -u /tmp/lin.py $c > "$OUT/pkg/$c.log" 2>&1; echo "[$c] rc=$?" >> "$OUT/pkg/rc.txt") &
  pids+=($!)
done
wait "${pids[@]}"
cat "$OUT/pkg/rc.txt"
for f in "$OUT"/pkg/*.log; do echo "== $f"; grep -E "OK|loaded|packaged|compiled|Error|error|line [0-9]+ in" "$f" | grep -v threading | head -12 | cut -c1-300; done
