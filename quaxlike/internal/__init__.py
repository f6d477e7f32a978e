"""Helpers for authors of Value types. No stability promise: see README.md."""

from .._higher_order._custom_ad import carry_into_backward_passes as carry_into_backward_passes
from .._higher_order._joins import joined as joined
from .._jax_compat import (
    AbstractValue as AbstractValue,
    jaxprs_in_params as jaxprs_in_params,
    jit_inlines_at_trace as jit_inlines_at_trace,
    ShapedArray as ShapedArray,
)
from .._known_values import (
    is_known as is_known,
    is_scale_invariant as is_scale_invariant,
    known_value as known_value,
)
from .._logical_sharding import (
    cannot_follow as cannot_follow,
    follow_axes as follow_axes,
    has_explicit_axes as has_explicit_axes,
    logical_entries as logical_entries,
    with_leaf_specs as with_leaf_specs,
)
from .._values import (
    array_for_derivatives as array_for_derivatives,
    materialise_value as materialise_value,
)
from ._cached_rule import cached_rule as cached_rule
from ._helpers import holding_known_zeros as holding_known_zeros, output_aval as output_aval
from ._labels import (
    bind_dot_general as bind_dot_general,
    contract_labelled as contract_labelled,
    dot_general_labels as dot_general_labels,
)
from ._primitives import TRANSCENDENTAL_PRIMITIVES as TRANSCENDENTAL_PRIMITIVES
