"""Units in the JAX type: `Unitful`, a quaxlike Value whose leaf is a hijax
`UnitfulArray`, so units show in jaxprs and gradients are per unit. Needs a JAX
with the hijax API (see `quaxlike.experimental.hijax`)."""

from ._unitful_array import (
    add as add,
    broadcast_in_dim as broadcast_in_dim,
    int_pow as int_pow,
    mul as mul,
    sum as sum,
    UnitfulArray as UnitfulArray,
    UnitfulArraySpec as UnitfulArraySpec,
    UnitfulArrayTy as UnitfulArrayTy,
    unwrap as unwrap,
    wrap as wrap,
)
from ._units import to_units as to_units, Units as Units
from ._value import MAPPED as MAPPED, Unitful as Unitful
