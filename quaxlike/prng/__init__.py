"""PRNG keys as Values: `PRNGKeyValue`, which works with `jax.random` and refuses
arithmetic."""

from . import _rules  # noqa: F401  (registers PRNGKeyValue's rules)
from ._functions import (
    fold_in as fold_in,
    normal as normal,
    split as split,
    uniform as uniform,
)
from ._quax_names import PRNG as PRNG, ThreeFry as ThreeFry
from ._value import KeyArithmeticError as KeyArithmeticError, PRNGKeyValue as PRNGKeyValue
