"""Named axes: `NamedArray` checks that operations line its axes up by name."""

from . import _rules  # noqa: F401  (registers NamedArray's rules)
from ._ops import (
    align as align,
    dot as dot,
    rename as rename,
    sum as sum,
    trace as trace,
)
from ._quax_names import Axis as Axis
from ._value import (
    AxisName as AxisName,
    NamedArray as NamedArray,
    NamedAxisError as NamedAxisError,
    NamedContractionError as NamedContractionError,
)
