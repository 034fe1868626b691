"""The verify step of speculative decoding on the decode path: a decode step whose requests have N
query rows each (the newest token, then N - 1 drafts), acceptance on the device, through the same
staging, refresh and ``GraphRunner`` as plain decode.

A verify step of ``n`` requests pads to the decode-ladder size ``bs >= n`` (as decode does) and runs the
graph ``GraphKey("decode", bs, bs * N, N, greedy)``, captured on first use or at start-up
(``capture_ladder``); above the ladder, or without graphs, the same compiled step runs unpadded. What
the graph reads: the staged ids, positions and drafts (``DecodeStaging.fill_verify``), the decode
metadata the refresh rewrote for ``bs * N`` rows (or, with ``graphed_refresh``, the staged tables it
refreshes itself, as decode's graphs do), the sampling inputs; what it writes: the emitted tokens
(accepted drafts, the target's token, then -1) and accepted counts, side by side in one persistent
``[bs, N + 1]`` buffer read back once per step. Padding requests have no drafts and write only the null
page and the null state slot. With recurrent-state layers the step ends by committing each request's
state at its accepted length (``StateBackend.commit_verify``), on the device. Plain decode (N = 1) never
comes here: ``DecodeStep.run`` is unchanged.
"""

from __future__ import annotations

import torch

from tscompile.backend import compile_step
from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
from tscompile.runtime.graph_runner import DECODE, GraphKey
from tscompile.step_plan import StepPlan

import tscompile.custom_ops.acceptance  # noqa: F401  registers tscompile::accept_greedy / accept_rejection


class VerifyGraphs:
    """``run(plan) -> [n, N + 1]`` int64 device tensor (the emitted tokens, then the accepted count);
    ``capture_ladder(width)``. ``decode``: the engine's ``DecodeStep`` (its model, attention,
    staging, clock, graphs and config)."""

    def __init__(self, decode, *, max_num_seqs: int, max_width: int):
        self.decode = decode
        device = decode.device
        self.rows = torch.arange(max_num_seqs * max_width, device=device)  # every window row is a logits row
        self.tokens = torch.full((max_num_seqs * max_width,), -1, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        # the step's one read-back, emitted tokens then the accepted count per request, written by the
        # step itself (inside its graph) so that a replay launches nothing after it
        self.emitted = torch.full((max_num_seqs * (max_width + 1),), -1, dtype=torch.int64, device=device)
        self._read_views: dict[tuple[int, int, int], torch.Tensor] = {}
        self.no_probs = torch.zeros(0, 0, device=device)  # the drafters' q is one-hot
        self._indptr: dict[tuple[int, int], torch.Tensor] = {}
        self._views: dict[tuple[int, int], tuple] = {}
        config = decode.config
        self.compiled = self.forward if config is None else compile_step(self.forward, config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, drafts: torch.Tensor,
                draft_indptr: torch.Tensor, out_tokens: torch.Tensor, out_accepted: torch.Tensor,
                all_greedy: bool) -> None:
        """The compiled function: the target's logits of every window row, then acceptance into
        ``out_tokens`` / ``out_accepted`` (greedy prefix match, or rejection sampling)."""
        logits = self.decode.model(input_ids, positions)
        if all_greedy:
            torch.ops.tscompile.accept_greedy(logits, drafts, draft_indptr, out_tokens, out_accepted)
        else:
            s, bs = self.decode.staging.sampling_inputs, out_tokens.shape[0]
            torch.ops.tscompile.accept_rejection(logits, drafts, self.no_probs, draft_indptr, s.temperature[:bs],
                                                 s.top_k[:bs], s.top_p[:bs], s.seeds[:bs], s.steps[:bs], out_tokens,
                                                 out_accepted)
        state = getattr(self.decode.attention, "state", None)
        if state is not None:  # recurrent-state layers: back to the state after the kept rows
            state.commit_verify(out_accepted, out_tokens.shape[1] - 1)

    def _step_views(self, bs: int, width: int) -> tuple:
        """The inputs and outputs of a ``bs`` x ``width`` step: views made once, so a graph's
        addresses never move."""
        views = self._views.get((bs, width))
        if views is None:
            st, rows, k = self.decode.staging, bs * width, width - 1
            indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.rows.device) * k
            views = self._views[(bs, width)] = (
                st.input_ids[:rows], st.positions[:rows], st.drafts[:bs * k], indptr,
                self.tokens[:rows].view(bs, width), self.accepted[:bs], self.rows[:rows],
                self.emitted[:bs * (width + 1)].view(bs, width + 1))
        return views

    def _read_view(self, bs: int, width: int, n: int) -> torch.Tensor:
        """The ``[n, N + 1]`` rows of the read-back buffer (made once: a slice costs host time per step)."""
        view = self._read_views.get((bs, width, n))
        if view is None:
            view = self._read_views[(bs, width, n)] = self._step_views(bs, width)[7][:n]
        return view

    def run_compiled(self, bs: int, width: int, greedy: bool) -> None:
        ids, pos, drafts, indptr, tokens, accepted, rows, emitted = self._step_views(bs, width)
        with forward_context(ForwardContext(ForwardMode.DECODE, self.decode.attention, rows)):
            self.decode.clock.run("verify", self.compiled, ids, pos, drafts, indptr, tokens, accepted, greedy)
        torch.cat([tokens, accepted[:, None].to(torch.int64)], dim=1, out=emitted)

    def run(self, plan: StepPlan) -> torch.Tensor:
        d, n, width, greedy = self.decode, plan.num_requests, plan.verify_width, plan.sampling.all_greedy
        graphs = d.graphs
        bs = n if graphs is None else graphs.decode_size(n)
        key = None if graphs is None else graphs.decode_key(bs, greedy, width)
        if key is not None and key not in graphs.graphs:
            self.capture(key)
        in_graph = key is not None and d.graphed_refresh
        d.staging.fill_verify(plan, bs, pad_tables=in_graph)
        d.staging.upload()
        if in_graph:
            d.attention.publish_decode_views(bs, width)
        else:
            d.attention.refresh_decode_metadata(bs, d.staging.decode_inputs(n, plan).with_width(width))
        if key is not None:
            graphs.replay_graph(key)
        else:
            self.run_compiled(bs, width, greedy)
        return self._read_view(bs, width, n)

    # -- capture -------------------------------------------------------------------------------------
    def idle_inputs(self, bs: int, width: int) -> None:
        """Before a capture: the idle refresh of ``bs * width`` rows, every request a padding request."""
        self.decode.idle_inputs(bs, width)
        self.decode.staging.drafts[: bs * (width - 1)].fill_(-1)

    def capture(self, key: GraphKey) -> None:
        bs, width, greedy = key.batch_size, key.width, key.greedy
        self.decode.capture_step(key, lambda: self.run_compiled(bs, width, greedy),
                                 prepare=lambda: self.idle_inputs(bs, width))

    def capture_ladder(self, width: int) -> None:
        """Capture the greedy verify graph of every ladder size at ``width``, largest first."""
        graphs = self.decode.graphs
        if graphs is None or not graphs.decode_ladder or not graphs.replay:
            return
        sizes = sorted(graphs.decode_ladder, reverse=True)
        graphs.capture_all(DECODE, sizes, lambda bs: self.capture(graphs.decode_key(bs, True, width)),
                           self.decode.device)
