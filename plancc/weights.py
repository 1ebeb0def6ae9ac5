"""``plancc.weights``, the documented path of Hugging Face weights in and out
(``plancc.runtime.weights``)."""

from .runtime.weights import export_hf, has_safetensors, load_hf_weights

__all__ = ["export_hf", "has_safetensors", "load_hf_weights"]
