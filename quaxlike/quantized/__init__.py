"""Quantised weights: `Int8Array` (one scale per output channel), `Int4Array` (one
scale per group of inputs, two codes per byte) and `NF4Array` (4-bit NormalFloat
codes, optionally with double-quantised scales), with matrix-product and
indexing rules that never build the dense weight, rounded to nearest or
calibrated (GPTQ, AWQ); the microscaling formats `MXArray` (mxfp8, mxfp4) and
`NVFP4Array`; `W8A8Array` (int8 activations per token times int8 weights);
training in low precision: `fake_quantize` (quantisation-aware training) and
`float8_training` (`Float8Weight`); and the layouts of PyTorch's 4-bit
checkpoints as they are stored, read by `quaxlike.checkpoints`:
`GroupedIntArray` (GPTQ, AWQ, compressed-tensors) and `Bnb4bitArray`
(bitsandbytes). The docs' "Low precision" page shows them together."""

from . import (  # noqa: F401  (register the quantised arrays' rules)
    _float8_rules,
    _indexing,
    _layout_rules,
    _matmul,
    _microscaling_rules,
    _qat_rules,
    _rules,
)
from ._awq import AWQ as AWQ, InputScaled as InputScaled
from ._base import QuantizedArray as QuantizedArray
from ._bnb import Bnb4bitArray as Bnb4bitArray
from ._calibration import CalibrationError as CalibrationError
from ._float8 import (
    float8_training as float8_training,
    Float8Weight as Float8Weight,
    unwrap_float8 as unwrap_float8,
)
from ._gptq import GPTQ as GPTQ
from ._grouped import (
    GroupedIntArray as GroupedIntArray,
    pack_words as pack_words,
    unpack_words as unpack_words,
)
from ._inspect import largest_dequantized as largest_dequantized
from ._matmul import default_matmul as default_matmul, with_matmul as with_matmul
from ._microscaling import (
    MicroscaledArray as MicroscaledArray,
    MXArray as MXArray,
    NVFP4Array as NVFP4Array,
)
from ._microscaling_quantize import (
    quantize_mx as quantize_mx,
    quantize_nvfp4 as quantize_nvfp4,
)
from ._model import dequantize as dequantize, quantize as quantize
from ._nf4 import (
    NF4_LEVELS as NF4_LEVELS,
    NF4Array as NF4Array,
    normal_float_levels as normal_float_levels,
    quantize_nf4 as quantize_nf4,
)
from ._qat import (
    ActivationFakeQuantized as ActivationFakeQuantized,
    fake_quantize as fake_quantize,
    fake_quantize_tokens as fake_quantize_tokens,
    FakeQuantized as FakeQuantized,
)
from ._value import (
    Int4Array as Int4Array,
    Int8Array as Int8Array,
    quantize_int4 as quantize_int4,
    quantize_int8 as quantize_int8,
)
from ._w8a8 import (
    quantize_rows_int8 as quantize_rows_int8,
    quantize_w8a8 as quantize_w8a8,
    W8A8Array as W8A8Array,
)
