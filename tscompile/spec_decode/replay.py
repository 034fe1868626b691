"""The replay drafter (benchmarks only): proposes a given reference continuation of each request.

Given the target's own greedy output for a prompt, every draft is accepted, so a benchmark measures
the verify path's ceiling (k + 1 tokens per step) on any weights, random ones included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tscompile.spec_decode.drafter import DraftBatch, Drafter, Drafts


class ReplayDrafter(Drafter):
    """references[request_id]: the output tokens (after the prompt) to replay; a request without
    one, or past its end, gets no drafts (-1). ``set_references`` gives them by prompt instead (the
    engine's request ids are its own): a request's reference is looked up by its prompt once."""

    def __init__(self, references: Mapping[object, Sequence[int]]):
        self.references = {rid: np.asarray(ref, dtype=np.int64) for rid, ref in references.items()}
        self.by_prompt: dict[tuple[int, ...], np.ndarray] = {}

    def set_references(self, by_prompt: Mapping[Sequence[int], Sequence[int]]) -> None:
        """``by_prompt[prompt token ids]``: the continuation of that prompt to replay."""
        self.by_prompt = {tuple(int(t) for t in p): np.asarray(ref, dtype=np.int64) for p, ref in by_prompt.items()}

    def _reference(self, rid, tokens: np.ndarray, prompt_len: int) -> np.ndarray | None:
        ref = self.references.get(rid)
        if ref is None and self.by_prompt:
            ref = self.by_prompt.get(tuple(tokens[:prompt_len].tolist()))
            if ref is not None:
                self.references[rid] = ref
        return ref

    def propose(self, batch: DraftBatch) -> Drafts:
        k = batch.num_speculative_tokens
        out = np.full((batch.size, k), -1, dtype=np.int64)
        for i, (rid, tokens, prompt_len) in enumerate(zip(batch.request_ids, batch.token_ids, batch.prompt_lens)):
            ref = self._reference(rid, tokens, prompt_len)
            if ref is None:
                continue
            done = len(tokens) - prompt_len  # output tokens so far: the next k of the reference follow
            nxt = ref[done: done + k]
            out[i, : nxt.shape[0]] = nxt
        return Drafts(out)

    def release(self, request_id) -> None:
        self.references.pop(request_id, None)
