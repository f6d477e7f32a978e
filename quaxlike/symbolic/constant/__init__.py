"""A symbolic constant array: `Constant(value, shape, dtype)` is one scalar filling
a shape, kept static or traced."""

from . import _rules  # noqa: F401  (registers Constant's rules)
from ._value import Constant as Constant
