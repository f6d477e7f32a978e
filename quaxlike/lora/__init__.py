"""Low-rank adaptation: `LoraArray` stands for `W + A @ B` without building it,
`DoraArray` for DoRA's `(m / ‖W + A @ B‖) ⊙ (W + A @ B)`, and
`LoraConvKernel` for a convolution kernel plus a low-rank update (both built on
`LowRankValue`). `loraify` and `qlora` adapt a model's weights, chosen with the
selection language of `quaxlike.selection`; `stack_adapters` and
`with_adapter` serve many adapters over one base; `save_peft`, `load_peft` and
`load_safetensors` read and write the Hugging Face layouts."""

from ..selection import module as module, select as select
from . import _conv, _dora_conv, _dora_rules, _gather, _rules  # noqa: F401  (register the rules)
from ._base import LowRankValue as LowRankValue
from ._conv import LoraConvKernel as LoraConvKernel
from ._dora import DoraArray as DoraArray, row_norms as row_norms
from ._dora_conv import DoraConvKernel as DoraConvKernel
from ._model import (
    adapted_paths as adapted_paths,
    loraify as loraify,
    merge as merge,
    partition as partition,
    trainable_filter as trainable_filter,
)
from ._multi import (
    adapter_count as adapter_count,
    multi_loraify as multi_loraify,
    MultiLoraArray as MultiLoraArray,
    stack_adapters as stack_adapters,
    with_adapter as with_adapter,
)
from ._peft import load_peft as load_peft, save_peft as save_peft
from ._qlora import qlora as qlora
from ._value import LoraArray as LoraArray


def __getattr__(name: str):
    # `load_safetensors` lives in `quaxlike.checkpoints` (a tool over models, which
    # builds on this package); `quaxlike.lora.load_safetensors` is the same function.
    if name == "load_safetensors":
        from ..checkpoints import load_safetensors

        return load_safetensors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
