"""Per-request recurrent state for linear-attention layers (Gated DeltaNet): the state backend's
storage, its slot allocator and the pointer-stable slot metadata a step publishes.

A linear-attention layer keeps a fixed-size state per request instead of a growing KV cache: the
last ``K - 1`` inputs of its short causal convolution (``conv[layer]: [S, C, K - 1]``) and the
recurrent state (``ssm[layer]: [S, Hv, Dk, Dv]``), both float32 so a long decode does not drift.
Every layer indexes them by the request's *state slot*; slot 0 is the null slot, reserved and never
handed out, which padding rows read and write (as padding KV rows use the null page).

The state of a request cannot be rolled back to an earlier position (the recurrence folds every
token in), so a preempted request gives its slot back and re-prefills from the start: its next
first chunk runs with ``has_state`` False, which starts from zeros instead of reading the slot.
For the same reason a cached KV prefix has no matching recurrent state, and hybrid models run with
prefix caching off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_SLOT = 0


@dataclass(frozen=True)
class StateSpec:
    """What a model declares about its recurrent-state layers.

    ``conv_channels``: the channels of the depthwise convolution (q, k and v projections together);
    ``conv_width``: its kernel ``K`` (the pool keeps ``K - 1`` inputs); the recurrent state is
    ``[num_v_heads, key_head_dim, value_head_dim]`` per layer and slot."""

    layer_ids: tuple[int, ...]
    conv_channels: int
    conv_width: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def slot_bytes(self) -> int:
        """float32 bytes of one slot across every state layer (conv window and recurrent state)."""
        per_layer = self.conv_channels * (self.conv_width - 1)
        per_layer += self.num_v_heads * self.key_head_dim * self.value_head_dim
        return 4 * per_layer * len(self.layer_ids)

    def decode_step_bytes(self, batch_size: int) -> int:
        """State bytes one decode step moves: every live slot's state read once and written once."""
        return 2 * self.slot_bytes * batch_size


class StateSlotAllocator:
    """Slot ids ``1 .. num_slots - 1`` (slot 0 is the null slot), one per admitted request."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"tscompile: a state pool needs at least 2 slots (1 reserved), got {num_slots}; "
                             f"raise max_num_seqs or the state pool size")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out low ids first
        self._owner: dict[object, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id) -> int:
        return self._owner[request_id]

    def allocate(self, request_id) -> int:
        """A slot for a newly admitted (or re-admitted after preemption) request."""
        if request_id in self._owner:
            raise ValueError(f"tscompile: request {request_id!r} already holds state slot "
                             f"{self._owner[request_id]}; free it before allocating again")
        if not self._free:
            raise ValueError(f"tscompile: no free state slot for request {request_id!r} ({self.num_slots - 1} "
                             f"usable slots, all held); admit fewer concurrent requests or enlarge the state pool")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def free(self, request_id) -> None:
        """Give a finished or preempted request's slot back. Its content is worthless from now on:
        a preempted request re-prefills from position 0 into whichever slot it gets next."""
        self._free.append(self._owner.pop(request_id))


class StatePool:
    """The state tensors of every recurrent-state layer, allocated once, and the slot allocator.

    The layers' tensors are stacked (``conv_all: [L, S, C, K - 1]``, ``ssm_all: [L, S, Hv, Dk, Dv]``,
    layers in ``spec.layer_ids`` order); ``conv[layer]`` / ``ssm[layer]`` are views of one layer. With
    speculative decoding, ``checkpoint_rows`` > 0 adds the verify steps' checkpoints, a row per
    request of a step and per window row but the last (``conv_checkpoints: [L, R, W, C, K - 1]``,
    ``ssm_checkpoints: [L, R, W, Hv, Dk, Dv]``): the state ops store into them, and
    ``tscompile::commit_state_checkpoints`` copies back the one at each request's accepted length,
    all layers in one launch."""

    def __init__(self, spec: StateSpec, conv_all: torch.Tensor, ssm_all: torch.Tensor, num_slots: int,
                 conv_checkpoints: torch.Tensor | None = None, ssm_checkpoints: torch.Tensor | None = None):
        self.spec = spec
        self.conv_all, self.ssm_all = conv_all, ssm_all
        self.conv = {lid: conv_all[i] for i, lid in enumerate(spec.layer_ids)}
        self.ssm = {lid: ssm_all[i] for i, lid in enumerate(spec.layer_ids)}
        self.conv_checkpoints, self.ssm_checkpoints = conv_checkpoints, ssm_checkpoints
        self.slots = StateSlotAllocator(num_slots)

    @classmethod
    def allocate(cls, spec: StateSpec, num_slots: int, device: torch.device | str, *, checkpoint_requests: int = 0,
                 checkpoint_rows: int = 0, free_bytes: int | None = None) -> "StatePool":
        """``checkpoint_requests`` x ``checkpoint_rows`` checkpoints per layer (0: none): for verify
        steps of up to that many requests and ``checkpoint_rows + 1`` rows each. ``free_bytes``: the
        device memory it may take (None: unchecked); a pool larger is refused before allocating."""
        StateSlotAllocator(num_slots)  # the refusal for a pool too small, before any allocation
        need = (num_slots + checkpoint_requests * checkpoint_rows) * spec.slot_bytes
        if free_bytes is not None and need > free_bytes:
            raise ValueError(f"tscompile: the recurrent state of {num_slots - 1} requests, with {checkpoint_rows} "
                             f"verify checkpoints each, takes {need / 2**30:.2f} GiB, more than the "
                             f"{free_bytes / 2**30:.2f} GiB free on the device; lower max_num_seqs or "
                             "num_speculative_tokens")
        layers = len(spec.layer_ids)
        conv_entry = (spec.conv_channels, spec.conv_width - 1)
        ssm_entry = (spec.num_v_heads, spec.key_head_dim, spec.value_head_dim)
        conv_all = torch.zeros(layers, num_slots, *conv_entry, dtype=torch.float32, device=device)
        ssm_all = torch.zeros(layers, num_slots, *ssm_entry, dtype=torch.float32, device=device)
        checkpoints = (None, None)
        if checkpoint_rows > 0:
            lead = (layers, checkpoint_requests, checkpoint_rows)
            checkpoints = (torch.zeros(*lead, *conv_entry, dtype=torch.float32, device=device),
                           torch.zeros(*lead, *ssm_entry, dtype=torch.float32, device=device))
        return cls(spec, conv_all, ssm_all, num_slots, *checkpoints)

    @property
    def checkpoint_rows(self) -> int:
        """Window rows a verify step may have beyond its first (0: no checkpoints)."""
        return 0 if self.ssm_checkpoints is None else self.ssm_checkpoints.shape[2]

    @property
    def checkpoint_requests(self) -> int:
        """Requests a verify step may have (0: no checkpoints)."""
        return 0 if self.ssm_checkpoints is None else self.ssm_checkpoints.shape[1]

    @property
    def nbytes(self) -> int:
        """The slots' bytes and the checkpoints'."""
        return sum(t.nbytes for t in self._tensors())

    def layer_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer_id], self.ssm[layer_id]

    def layer_checkpoints(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer_id``'s ``[R, W, ...]`` checkpoints (conv, ssm), or None without speculation."""
        if self.ssm_checkpoints is None:
            return None
        i = self.spec.layer_ids.index(layer_id)
        return self.conv_checkpoints[i], self.ssm_checkpoints[i]

    def fill_(self, value: float) -> None:
        """Poison every slot and checkpoint (tests use it to prove a slot was or was not read)."""
        for t in self._tensors():
            t.fill_(value)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.conv_all, self.ssm_all, self.conv_checkpoints, self.ssm_checkpoints) if t is not None]


class StateSlotMetadata:
    """Pointer-stable slot metadata per batch size: ``state_slots [bs]`` int64 and ``has_state
    [bs]`` bool device buffers, allocated once per size and refreshed in place, so a decode graph
    captured at a bucket keeps reading the same addresses on every replay. Rows past the live ones
    are padding: the null slot, starting fresh (their output is discarded)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size not in self._buffers:
            self._buffers[batch_size] = (torch.zeros(batch_size, dtype=torch.int64, device=self.device),
                                         torch.zeros(batch_size, dtype=torch.bool, device=self.device))
        return self._buffers[batch_size]

    def refresh(self, slots: list[int], has_state: list[bool], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the live rows' slots and flags into the ``batch_size`` buffers; pad the rest."""
        if len(slots) != len(has_state) or len(slots) > batch_size:
            raise ValueError(f"tscompile: state metadata for {len(slots)} slots / {len(has_state)} flags does not "
                             f"fit batch size {batch_size}; pass one flag per slot and a bucket >= the live rows")
        pad = batch_size - len(slots)
        host_slots = torch.tensor(list(slots) + [NULL_SLOT] * pad, dtype=torch.int64)
        host_flags = torch.tensor(list(has_state) + [False] * pad, dtype=torch.bool)
        state_slots, flags = self.buffers(batch_size)
        state_slots.copy_(host_slots, non_blocking=True)
        flags.copy_(host_flags, non_blocking=True)
        return state_slots, flags
