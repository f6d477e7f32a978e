"""Codes in `int32` words, in NumPy, for the loaders and writers: code `j` of a
word in bits `j * bits` upwards (lowest first), as GPTQ, AWQ (in its own field
order) and compressed-tensors pack them. `quaxlike.quantized.pack_words` packs;
this unpacks, on the host, a layer at a time."""

import numpy as np


def unpack_words(words: np.ndarray, bits: int, columns: int | None = None) -> np.ndarray:
    """`uint8` codes `(..., k * 32 // bits)` of `int32` words `(..., k)`, cut to
    `columns` where given."""
    unsigned = np.asarray(words).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (unsigned[..., None] >> shifts) & np.uint32(2**bits - 1)
    codes = codes.reshape(*unsigned.shape[:-1], -1).astype(np.uint8)
    return codes if columns is None else codes[..., :columns]
