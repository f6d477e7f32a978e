"""Arrays with physical units: `Unitful(array, unit)`, with a small unit algebra."""

from . import _functions, _linalg, _rules  # noqa: F401  (register Unitful's rules)
from ._constants import plain_constants_take_units as plain_constants_take_units
from ._quax_names import (
    as_unit as as_unit,
    Dimension as Dimension,
    kilograms as kilograms,
    meters as meters,
    seconds as seconds,
    units_of as units_of,
)
from ._unit import (
    A as A,
    cm as cm,
    dimensionless as dimensionless,
    gram as gram,
    hour as hour,
    Hz as Hz,
    J as J,
    K as K,
    kg as kg,
    km as km,
    m as m,
    minute as minute,
    N as N,
    s as s,
    Unit as Unit,
    W as W,
)
from ._value import UnitError as UnitError, Unitful as Unitful
