"""tscompile: an LLM execution backend that lives inside torch.compile."""

from tscompile import custom_ops  # noqa: F401  (registers the tscompile:: ops)
from tscompile.runtime.engine import LLM
from tscompile.sampling import SamplingParams
from tscompile.export import load_package
from tscompile.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__", "load_package"]
