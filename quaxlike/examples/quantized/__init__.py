"""Quantised weights: `Int8Array` (one scale per output channel) and `Int4Array`
(one scale per group of inputs, two codes per byte), with matrix-product and
indexing rules that never build the dense weight."""

from . import _indexing, _matmul, _rules  # noqa: F401  (register the quantised arrays' rules)
from ._inspect import largest_dequantized as largest_dequantized
from ._value import (
    dequantize as dequantize,
    Int4Array as Int4Array,
    Int8Array as Int8Array,
    quantize as quantize,
    quantize_int4 as quantize_int4,
    quantize_int8 as quantize_int8,
    QuantizedArray as QuantizedArray,
)
