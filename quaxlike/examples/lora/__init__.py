"""Low-rank adaptation: `LoraArray` stands for `W + A @ B` without building it, and
`LoraConvKernel` for a convolution kernel plus a low-rank update."""

from . import _conv, _gather, _rules  # noqa: F401  (register the rules)
from ._conv import LoraConvKernel as LoraConvKernel
from ._model import (
    adapted_paths as adapted_paths,
    loraify as loraify,
    merge as merge,
    partition as partition,
    trainable_filter as trainable_filter,
)
from ._qlora import qlora as qlora
from ._value import LoraArray as LoraArray
