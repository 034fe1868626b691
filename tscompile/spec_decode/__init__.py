"""Speculative decoding: settings, drafters and the glue that builds a drafter from the settings.

The verify step itself lives below (the width-N decode refresh and attention, the acceptance ops
in ``tscompile.custom_ops.acceptance``); this package holds what runs on the host around it."""

from tscompile.spec_decode.commit import commit_emitted, kv_len_after
from tscompile.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from tscompile.spec_decode.drafter import DraftBatch, Drafter, Drafts, pad_rows
from tscompile.spec_decode.draft_model import DraftModelDrafter, DraftModelRunner
from tscompile.spec_decode.ngram import NgramDrafter, lookup_continuation
from tscompile.spec_decode.replay import ReplayDrafter

__all__ = [
    "DraftBatch", "DraftModelDrafter", "DraftModelRunner", "Drafter", "Drafts", "MAX_NUM_SPECULATIVE_TOKENS",
    "NgramDrafter", "ReplayDrafter", "SpeculativeConfig", "commit_emitted", "kv_len_after", "lookup_continuation",
    "pad_rows",
]
