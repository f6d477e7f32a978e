"""A symbolic array of zeros: `Zero(shape, dtype)`."""

from . import _rules  # noqa: F401  (registers Zero's rules)
from ._value import Zero as Zero
