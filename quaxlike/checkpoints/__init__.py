"""Checkpoints of the PyTorch ecosystem in and out: `load_safetensors` reads a
safetensors checkpoint into a model through a name map, with the 4-bit layouts
of bitsandbytes, GPTQ, AWQ and compressed-tensors read exactly as quantised
Values; `save_bnb_4bit` and `save_compressed_tensors` write a model's quantised
weights in the layouts bitsandbytes and compressed-tensors (vLLM) serve."""

from ._load import load_safetensors as load_safetensors
from ._write import (
    save_bnb_4bit as save_bnb_4bit,
    save_compressed_tensors as save_compressed_tensors,
)
