#!/usr/bin/env bash
# Where does loading an exported package crash on CUDA? Each case in its own process, faulthandler on.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/pkg"
cat > /tmp/lin.py <<'P'
import sys, torch
from torch.export.pt2_archive._package import package_pt2, load_pt2
n, dev = int(sys.argv[1]), sys.argv[2]
m = torch.nn.Linear(8, 8).to(dev); x = torch.randn(3, 8, device=dev)
ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))
f = torch._inductor.aot_compile(ep.module(), (x,), {}, options={"aot_inductor.package": True})
p = f"/tmp/lin{n}{dev}.pt2"
package_pt2(p, aoti_files={"prefill": f, "decode": f} if n == 2 else {"model": f}, extra_files={"t.json": "{}"})
print("packaged", flush=True)
for idx in (0, -1):
    c = load_pt2(p, device_index=idx); r = list(c.aoti_runners.values())[0]
    print("loaded idx", idx, (r(x)[0] - m(x)).abs().max().item(), flush=True)
P
cat > /tmp/tiny.py <<'P'
import sys, torch, tscompile, tscompile.export as E
w, dev = sys.argv[1], sys.argv[2]
E.export_package("llama-tiny", f"/tmp/tiny_{w}.pt2", device=dev, max_num_seqs=4, max_model_len=64, page_size=4,
                 max_num_batched_tokens=32, weights=w)
print("exported", flush=True)
l = tscompile.load_package(f"/tmp/tiny_{w}.pt2"); print("loaded", flush=True)
P = [[5, 17, 3, 99, 42], [300], [77, 66]]; s = tscompile.SamplingParams(max_new_tokens=4)
ref = tscompile.LLM("llama-tiny", device=dev, max_num_seqs=4, max_model_len=64, page_size=4, max_num_batched_tokens=32,
                    enforce_eager=True).generate(P, s)
print("equal", l.generate(P, s) == ref, flush=True)
P
for a in "1 cuda" "2 cuda"; do (timeout 200 python3 -X faulthandler -u /tmp/lin.py $a > "$OUT/pkg/lin_${a// /_}.log" 2>&1; echo "[lin $a] rc=$?") & done
for a in "inside cuda" "external cuda"; do (timeout 230 python3 -X faulthandler -u /tmp/tiny.py $a > "$OUT/pkg/tiny_${a// /_}.log" 2>&1; echo "[tiny $a] rc=$?") & done
wait
for f in "$OUT"/pkg/*.log; do echo "== $f"; grep -v -i "warn" "$f" | tail -25 | cut -c1-400; done
