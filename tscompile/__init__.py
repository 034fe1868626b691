"""tscompile: an LLM execution backend that lives inside torch.compile.

Importing the package registers the ``tscompile::`` ops and nothing more: ``torch.compile(...,
backend="tscompile")`` loads the backend, its passes and the ops, never the engine, the models, the
packages or the bench. The engine's names (``LLM``, ``SamplingParams``, ``load_package``, ...) are
attributes resolved on first use.
"""

from __future__ import annotations

import importlib
import importlib.util

from tscompile import custom_ops  # noqa: F401  (registers the tscompile:: ops)
from tscompile.version import __version__

# public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "LLM": "tscompile.runtime.engine",
    "SamplingParams": "tscompile.sampling",
    "load_package": "tscompile.export",
    "export_package": "tscompile.export",
    "TscompileConfig": "tscompile.config",
    "KernelPolicy": "tscompile.kernel_policy",
}

__all__ = ["KernelPolicy", "LLM", "SamplingParams", "TscompileConfig", "__version__", "export_package",
           "load_package"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"tscompile.{name}") is not None:
        value = importlib.import_module(f"tscompile.{name}")  # a subpackage: ``tscompile.models`` and the like
    else:
        raise AttributeError(f"module 'tscompile' has no attribute {name!r}")
    globals()[name] = value  # read once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
