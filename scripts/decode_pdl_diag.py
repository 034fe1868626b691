"""Where the PDL decode launch differs from the plain one (H200 diagnostic, no assertions).

The GPU test ``test_decode_pdl_in_a_graph_after_a_writer_gives_the_plain_launchs_bits_gpu`` found
the PDL graph's output bits differing from the plain graph's. This tells a race (differences only in
a graph, changing from replay to replay) from a code difference (eager PDL launches differing too,
the same way every time), and shows which rows, heads and values differ.

    python3 scripts/decode_pdl_diag.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_triton_decode_write import SCALE, _bits, _poisoned_batch  # noqa: E402

from tscompile.bench.graph_timing import capture_graph  # noqa: E402
from tscompile.custom_ops import triton_attention as ta  # noqa: E402


def describe(name: str, got: torch.Tensor, want: torch.Tensor, bs: int) -> None:
    differ = _bits(got) != _bits(want)
    if not differ.any():
        print(f"  {name}: same bits")
        return
    rows = differ.reshape(differ.shape[0], -1).any(1).nonzero().flatten().tolist()
    live = differ[:bs]
    print(f"  {name}: {int(differ.sum())} elements differ; rows {rows[:12]} (bs {bs})")
    if live.any():
        g, w = got[:bs][live].float(), want[:bs][live].float()
        print(f"    live rows: max |diff| {float((g - w).abs().nan_to_num(nan=float('inf')).max()):.3g}, "
              f"nan got/want {int(g.isnan().sum())}/{int(w.isnan().sum())}; "
              f"heads {live.any(-1).any(0).nonzero().flatten().tolist()[:16]}")
        print(f"    first pairs {[(float(a), float(b)) for a, b in zip(g[:4], w[:4])]}")
    pad = differ[bs:]
    if pad.any():
        print(f"    padded rows: got {got[bs:][pad][:4].tolist()} want {want[bs:][pad][:4].tolist()}")


def main() -> None:
    dev = torch.device("cuda")
    for bs, longest in ((1, 48), (1, 2000), (33, 2000)):
        kv_lens = [longest] + [int(x) for x in torch.randint(1, min(longest, 700), (bs - 1,),
                                                              generator=torch.Generator().manual_seed(bs + longest))]
        batch = _poisoned_batch(kv_lens, 1, dev, num_kv_heads=8, group=4, head_dim=128,
                                dtype=torch.bfloat16, seed=bs)
        sources = {n: batch[n].clone() for n in ("q", "k", "v")}
        print(f"== bs {bs}, longest {longest}, splits {ta._decode_launch(batch['q'], batch['k_cache'], batch['page_table'])[5]}")

        def setup(pdl: bool):
            live = {n: torch.empty_like(t) for n, t in sources.items()}
            k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
            out = torch.empty_like(batch["q"])

            def step():
                for n in live:
                    torch.mul(sources[n], 1.0, out=live[n])
                ta.triton_attention(live["q"], live["k"], live["v"], k_cache, v_cache, out, batch["page_table"],
                                    batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], SCALE, True,
                                    decode_pdl=pdl)
            return step, out, k_cache, (live, v_cache)

        # eager: no graph, fresh caches per call
        eager = {}
        for pdl in (False, True, False):
            step, out, k_cache, _ = setup(pdl)
            out.fill_(float("nan"))
            step()
            torch.cuda.synchronize()
            eager.setdefault(pdl, []).append((out.clone(), k_cache.clone()))
        describe("eager plain vs eager plain", eager[False][1][0], eager[False][0][0], bs)
        describe("eager pdl vs eager plain", eager[True][0][0], eager[False][0][0], bs)
        describe("eager pdl cache vs plain", eager[True][0][1], eager[False][0][1], bs)

        graphs = {}
        for name, pdl in (("plain", False), ("plain2", False), ("pdl", True), ("pdl2", True)):
            step, out, k_cache, live = setup(pdl)
            graphs[name] = (capture_graph(step), out, k_cache, live)  # live must outlive the graph
        for seed in (1, 2, 3):
            g = torch.Generator("cuda").manual_seed(seed)
            for t in sources.values():
                t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
            res = {}
            for name, (graph, out, k_cache, _) in graphs.items():
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                res[name] = (out.clone(), k_cache.clone())
            # eager reference of the same sources
            step, out, k_cache, _ = setup(False)
            out.fill_(float("nan"))
            step()
            torch.cuda.synchronize()
            print(f" seed {seed}")
            describe("graph plain vs eager", res["plain"][0], out, bs)
            describe("graph plain2 vs plain", res["plain2"][0], res["plain"][0], bs)
            describe("graph pdl vs plain", res["pdl"][0], res["plain"][0], bs)
            describe("graph pdl2 vs pdl", res["pdl2"][0], res["pdl"][0], bs)
            describe("graph pdl cache vs plain", res["pdl"][1], res["plain"][1], bs)


if __name__ == "__main__":
    main()
