"""What the compiler sees: the ``tscompile::`` op schemas, their fake kernels and real kernels.

Importing this package registers every op. Kernels are chosen per call by the ``impl`` string the
attention backend passes; the torch implementation is the oracle every other one is tested against.
"""

from tscompile.custom_ops import (  # noqa: F401
    acceptance, attention, gated_delta, gated_delta_fused, metadata, narrow, sampling)
from tscompile.custom_ops.attention import attention_impls, register_attention_impl
from tscompile.custom_ops.metadata import register_refresh_impl

__all__ = ["attention_impls", "register_attention_impl", "register_refresh_impl"]
