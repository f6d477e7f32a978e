"""Interval arithmetic: `Interval(lo, hi)` carries a lower and an upper bound on
every element through unchanged JAX code, and refuses what it cannot bound soundly."""

from . import _rules  # noqa: F401  (registers Interval's rules)
from ._monotone import MONOTONE as MONOTONE
from ._value import Interval as Interval
