"""``TSCOMPILE_DEBUG_DIR``: write the split plan and every piece's FX code for a human to read."""

from __future__ import annotations

import itertools
import os

import torch.fx

from tscompile.passes.split import SplitPlan

_graph_ids = itertools.count()


def dump_split(debug_dir: str, gm: torch.fx.GraphModule, split: torch.fx.GraphModule | None,
               plan: SplitPlan | None) -> str:
    """Write ``graph_<n>/`` with the traced graph, the split plan and each piece; returns the folder."""
    folder = os.path.join(debug_dir, f"graph_{next(_graph_ids)}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "traced.py"), "w") as f:
        f.write(gm.code)
    if split is None or plan is None:
        with open(os.path.join(folder, "plan.txt"), "w") as f:
            f.write("no break: one piece\n")
        return folder
    with open(os.path.join(folder, "plan.txt"), "w") as f:
        f.write(plan.describe() + "\n")
    with open(os.path.join(folder, "split.py"), "w") as f:
        f.write(split.code)
    for piece in plan.pieces:
        sub = getattr(split, piece.name)
        code = sub.code if isinstance(sub, torch.fx.GraphModule) else repr(sub)
        with open(os.path.join(folder, f"{piece.name}_{piece.kind}.py"), "w") as f:
            f.write(code)
    return folder
