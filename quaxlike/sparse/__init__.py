"""A sparse array in coordinate format: `BCOO(data, indices, shape)`."""

from . import _rules  # noqa: F401  (registers BCOO's rules)
from ._value import BCOO as BCOO
