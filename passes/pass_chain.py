"""Several Inductor post-grad passes in the one ``post_grad_custom_post_pass`` slot."""

from __future__ import annotations

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass


class PassChain(CustomGraphPass):
    """Several post-grad passes in one slot (Inductor takes one), run in order."""

    def __init__(self, passes: list[CustomGraphPass]):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        return b"|".join(p.uuid() for p in self.passes)
