"""``plancc.weights``, the documented path of Hugging Face weights in and out
(``plancc.runtime.hf_weights`` in, ``plancc.engine.export`` out)."""

from .engine.export import export_hf
from .runtime.hf_weights import has_safetensors, load_hf_weights

__all__ = ["export_hf", "has_safetensors", "load_hf_weights"]
