"""Named axes: `NamedArray` checks that operations line its axes up by name."""

from . import _rules  # noqa: F401  (registers NamedArray's rules)
from ._ops import align as align, dot as dot, rename as rename, sum as sum
from ._value import Axis as Axis, NamedArray as NamedArray, NamedAxisError as NamedAxisError
