"""Quax's `structured_matrices` example under its own name: `TridiagonalMatrix`,
a `quaxlike.structured.TriDiagonal` with Quax's fields and refusal to
materialise."""

from ._value import TridiagonalMatrix as TridiagonalMatrix
