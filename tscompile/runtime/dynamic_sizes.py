"""What keeps the engine's two compiled steps at one dynamic graph each (plus decode's static bs=1).

Dynamo specializes on more than the sizes a step asks for. The causes met, and the answer to each:

- The sampling op writes ``tokens[:n]``, a view of a graph input. Functionalizing that write
  (``auto_functionalized_v2``) asks whether ``n`` differs from the buffer's rows and guards on the
  answer, so a step compiled with as many rows as the buffer (the decode ladder's top size, a full
  prefill batch) and one compiled with fewer could not share a graph. ``SpareRowSampling`` gives
  the token buffer one row no step writes: ``n`` is always smaller, the guard always holds.
- A compiled call made with grad mode on (the start-up decode capture) and one made under the
  runner's ``inference_mode`` guard on different global state, and the former traces a training
  graph (the parameters require grad). The runner enters inference mode around every compiled call.
- EXTEND and MIXED steps read one graph: the forward context hands layers ``attention_mode``, a
  field, so Dynamo guards on EXTEND's identity and not on the step's mode.
"""

from __future__ import annotations

import torch

from tscompile.sampling import SamplingBuffers, SamplingInputs


class SpareRowSampling(SamplingBuffers):
    """``SamplingBuffers`` whose token buffer has one row past ``max_rows``: steps write at most
    ``max_rows`` rows, so a written view ``tokens[:n]`` never spans the whole buffer."""

    def __init__(self, inputs: SamplingInputs):
        super().__init__(inputs)
        self.tokens = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=inputs.seeds.device)
