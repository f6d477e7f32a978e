"""quaxlike: multiple-dispatch array values for JAX and Equinox."""

import importlib.metadata

from . import _higher_order  # noqa: F401  (registers the higher-order rules)
from ._dense import DenseArrayValue as DenseArrayValue
from ._diagnostics import (
    AmbiguousRuleError as AmbiguousRuleError,
    BranchMaterialisationError as BranchMaterialisationError,
    CarryChangedError as CarryChangedError,
    CarryMaterialisationError as CarryMaterialisationError,
    ConflictingDefaultsError as ConflictingDefaultsError,
    JaxCompatibilityError as JaxCompatibilityError,
    LogicalShardingError as LogicalShardingError,
    MaterialisationError as MaterialisationError,
    QuaxlikeError as QuaxlikeError,
    ValueNotLiftedError as ValueNotLiftedError,
)
from ._explain import explain as explain, Report as Report
from ._logical_sharding import (
    device_put as device_put,
    leaf_shardings as leaf_shardings,
    leaf_specs as leaf_specs,
    with_sharding_constraint as with_sharding_constraint,
)
from ._operators import ArrayOperators as ArrayOperators
from ._policy import materialise_policy as materialise_policy
from ._quaxify import quaxify as quaxify
from ._rules import register as register, rules_for as rules_for
from ._values import ArrayValue as ArrayValue, Value as Value


try:
    __version__ = importlib.metadata.version("quaxlike")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"

from . import lax as lax, numpy as numpy  # noqa: E402  (they use the names above)


# The toolkits (`quaxlike.lora`, `quaxlike.quantized`, ...) are reachable after a
# bare `import quaxlike`, loaded on first use, as Quax's examples are; so are
# `quaxlike.examples` (their Quax-compatible names) and the short names it takes
# (`quaxlike.unitful` for `quaxlike.units`, `quaxlike.zero` for
# `quaxlike.symbolic.zero`, ...).
_TOOLKITS = (
    "checkpoints",
    "interval",
    "lora",
    "named",
    "prng",
    "quantized",
    "selection",
    "sharding",
    "sparse",
    "structured",
    "symbolic",
    "units",
)


def __getattr__(name: str):
    import importlib

    if name in _TOOLKITS:
        return importlib.import_module(f"{__name__}.{name}")
    examples = importlib.import_module(".examples", __name__)
    if name == "examples":
        return examples
    if name in examples.HOMES:
        return importlib.import_module(examples.HOMES[name])
    raise AttributeError(f"module 'quaxlike' has no attribute {name!r}")
