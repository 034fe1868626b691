"""Sampled tokens back to the host without stopping the stream.

A launched step's tokens are copied into a pinned host buffer behind the step on the stream, and an
event marks the copy; ``PendingTokens.wait`` blocks on that event only. With asynchronous
scheduling the engine waits for step N's tokens after launching step N + 1, so the host's
scheduling and staging of N + 1 overlap step N on the GPU. Two buffers in turn: step N + 1's copy
must not land in the buffer step N's tokens are still being read from. A step whose requests asked
for log-probabilities copies those too, behind the tokens and under the same event.
"""

from __future__ import annotations

import torch


class PendingTokens:
    __slots__ = ("_host", "_n", "_event", "_tokens", "_lp_host", "_logprobs")

    def __init__(self, host: torch.Tensor | None, n: int, event=None, tokens: list[int] | None = None,
                 lp_host: torch.Tensor | None = None):
        self._host, self._n, self._event, self._tokens = host, n, event, tokens
        self._lp_host, self._logprobs = lp_host, None

    @classmethod
    def ready(cls, tokens: list[int]) -> "PendingTokens":
        return cls(None, len(tokens), tokens=list(tokens))

    def wait(self) -> list[int]:
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            host = self._host if self._host.shape[0] == self._n else self._host[: self._n]
            self._tokens = host.tolist()
            if self._lp_host is not None:
                self._logprobs = self._lp_host.tolist()
        return self._tokens

    def logprobs(self) -> list[float] | None:
        """Each row's sampled-token log-probability, where the step copied them (else None)."""
        self.wait()
        return self._logprobs


class TokenReadback:
    def __init__(self, max_rows: int, device: torch.device):
        cuda = device.type == "cuda"
        # with its index: an index-less device costs every stream lookup a search for the current device
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda and device.index is None else device
        self._host = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._lp_host = [torch.zeros(max_rows, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        # events are reused: a buffer's earlier tokens are read (and kept) before its event is recorded again
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self._pending: list[PendingTokens | None] = [None, None]
        self._turn = 0
        # (buffer, n) -> that buffer's first n rows, made once: a torch slice per step costs
        # microseconds of dispatch
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def _host_rows(self, turn: int, n: int) -> torch.Tensor:
        rows = self._rows.get((turn, n))
        if rows is None:
            rows = self._rows[turn, n] = self._host[turn][:n]
        return rows

    def start(self, tokens: torch.Tensor, n: int | None = None, logprobs: torch.Tensor | None = None) -> PendingTokens:
        """Queue the copy of ``tokens`` (on the device, ``[n]``) behind the work launched so far, and of
        ``logprobs`` (``[n]`` float32) where given. ``n``: its row count where the caller knows it (a
        torch size read costs more than the int)."""
        turn = self._turn
        if n is None:
            n = tokens.shape[0]
        earlier = self._pending[turn]
        if earlier is not None:
            earlier.wait()  # whoever holds it still gets its tokens: read them before reusing the buffer
        self._turn ^= 1
        host = self._host_rows(turn, n)
        host.copy_(tokens, non_blocking=True)
        lp_host = None
        if logprobs is not None:
            lp_host = self._lp_host[turn][:n]
            lp_host.copy_(logprobs, non_blocking=True)
        event = self._events[turn]
        if event is not None:
            # on the engine's device's stream, which need not be the current device's
            event.record(torch.cuda.current_stream(self.device))
        pending = self._pending[turn] = PendingTokens(host, n, event, lp_host=lp_host)
        return pending
