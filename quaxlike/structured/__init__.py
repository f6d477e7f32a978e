"""Structured square matrices: `Identity`, `ScaledIdentity`, `Diagonal` and
`TriDiagonal`, with `O(n)` products and solves."""

from . import _linalg, _rules  # noqa: F401  (register the rules)
from ._value import (
    Diagonal as Diagonal,
    Identity as Identity,
    ScaledIdentity as ScaledIdentity,
    solve as solve,
    StructuredMatrix as StructuredMatrix,
    TriDiagonal as TriDiagonal,
)
