"""The child process of ``load_check``: load a package as a user would and run one short request.

Its own module, imported only by that child (``python -c``), because it imports ``tscompile`` whole,
which imports the exporter that starts the child."""

from __future__ import annotations

import sys

import tscompile
from tscompile.package.record import read_package_metadata


def load_once(path: str, device: str) -> None:
    """The child's work: ``load_package`` as a user calls it (with the smallest KV pool), then one
    token of prompt and two new tokens, so both the prefill and the decode program run."""
    bounds = read_package_metadata(path, check_integrity=False)["bounds"]
    max_model_len = min(bounds["max_model_len"], 16)
    llm = tscompile.load_package(path, device=device, max_num_seqs=1, max_model_len=max_model_len,
                                 max_num_batched_tokens=min(bounds["max_num_batched_tokens"], 16))
    if max_model_len >= 3:
        tokens = llm.generate([[0]], tscompile.SamplingParams(max_new_tokens=2))[0].outputs[0].token_ids
        if len(tokens) != 2:
            sys.exit(f"tscompile: the loaded package generated {len(tokens)} tokens where 2 were asked for")
