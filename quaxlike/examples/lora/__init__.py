"""Low-rank adaptation: `LoraArray` stands for `W + A @ B` without building it."""

from . import _rules  # noqa: F401  (registers LoraArray's rules)
from ._model import (
    loraify as loraify,
    merge as merge,
    partition as partition,
    trainable_filter as trainable_filter,
)
from ._qlora import qlora as qlora
from ._value import LoraArray as LoraArray
