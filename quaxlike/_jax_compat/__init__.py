"""Every use of JAX internals, found by probing rather than assumed.

quaxlike needs a few things JAX does not export publicly. Each is looked up
when quaxlike is imported, by feature (is the attribute there, what type does a
param have, what does a signature take), so that a JAX release that moves one
breaks nothing at import; what is missing is replaced by a stand-in that raises
`JaxCompatibilityError` when it is actually needed. One module per concern:

- `_probing`: the tested range, the JAX modules read, lookups and stand-ins;
- `_trace_api`: the trace and tracer base classes, the current trace, JAX's
  switches, binding a jaxpr's equations;
- `_primitives`: primitives of higher-order operations and the params whose
  form changed between releases;
- `_sharding`: `shard_map`'s hook protocol and varying manual axes;
- `_source`: hiding quaxlike's frames and finding the user's line.

README.md holds the inventory: what is used, what for, where each release
keeps it, and the fallback. The rest of quaxlike imports only this package.
"""

from .._diagnostics import JaxCompatibilityError as JaxCompatibilityError
from ._equinox import (
    callback_host_function as callback_host_function,
    create_vprim as create_vprim,
    filter_primitive_rules as filter_primitive_rules,
    FILTER_PRIMITIVES_FOUND as FILTER_PRIMITIVES_FOUND,
    leafwise_identity_primitives as leafwise_identity_primitives,
    select_if_vmap_p as select_if_vmap_p,
)
from ._primitives import (
    call_p as call_p,
    closed_call_p as closed_call_p,
    cond_p as cond_p,
    custom_call_primal_jaxpr as custom_call_primal_jaxpr,
    custom_jvp_call_p as custom_jvp_call_p,
    CUSTOM_VJP_BWD_RETURNS_LOGS as CUSTOM_VJP_BWD_RETURNS_LOGS,
    custom_vjp_call_p as custom_vjp_call_p,
    custom_vjp_cotangents as custom_vjp_cotangents,
    has_effects as has_effects,
    JIT_INLINE_AT_TRACE as JIT_INLINE_AT_TRACE,
    jit_inlines_at_trace as jit_inlines_at_trace,
    jit_needs_only_keep_unused as jit_needs_only_keep_unused,
    jit_options as jit_options,
    jit_p as jit_p,
    lax_primitive_by_name as lax_primitive_by_name,
    pvary_p as pvary_p,
    remat_p as remat_p,
    reshard_p as reshard_p,
    scan_layout as scan_layout,
    scan_p as scan_p,
    shard_map_p as shard_map_p,
    sharding_constraint_p as sharding_constraint_p,
    while_p as while_p,
)
from ._probing import (
    beyond_tested_range as beyond_tested_range,
    disabled_shortcuts as disabled_shortcuts,
    JAX_VERSION as JAX_VERSION,
    jex_core as jex_core,
    missing as missing,
    TESTED_RANGE as TESTED_RANGE,
)
from ._sharding import (
    bind_shard_map as bind_shard_map,
    FlatTree as FlatTree,
    map_shard_map_result as map_shard_map_result,
    shard_map_body_outputs as shard_map_body_outputs,
    SHARD_MAP_RETURNS_FLAT_TREE as SHARD_MAP_RETURNS_FLAT_TREE,
    varying_axes as varying_axes,
    with_varying_axes as with_varying_axes,
    with_varying_axes_of as with_varying_axes_of,
)
from ._source import (
    api_boundary as api_boundary,
    SourceLine as SourceLine,
    user_source_line as user_source_line,
    without_traced_frames as without_traced_frames,
)
from ._trace_api import (
    AbstractValue as AbstractValue,
    ArrayImpl as ArrayImpl,
    aval_key as aval_key,
    bind_params as bind_params,
    bind_with_trace as bind_with_trace,
    binder as binder,
    check_leaks_enabled as check_leaks_enabled,
    check_no_leaks as check_no_leaks,
    ClosedJaxpr as ClosedJaxpr,
    concreteness_reader as concreteness_reader,
    current_eqn_context as current_eqn_context,
    current_name_stack as current_name_stack,
    current_trace as current_trace,
    current_trace_reader as current_trace_reader,
    eager_trace as eager_trace,
    eval_jaxpr as eval_jaxpr,
    init_tracer as init_tracer,
    is_eager as is_eager,
    is_primitive as is_primitive,
    Jaxpr as Jaxpr,
    jaxpr_as_fun as jaxpr_as_fun,
    jaxprs_in_params as jaxprs_in_params,
    jit_disabled as jit_disabled,
    Literal as Literal,
    Primitive as Primitive,
    Ref as Ref,
    register_tracer_class as register_tracer_class,
    set_current_trace as set_current_trace,
    set_name_stack as set_name_stack,
    ShapedArray as ShapedArray,
    take_current_trace as take_current_trace,
    to_concrete_value as to_concrete_value,
    Trace as Trace,
    Tracer as Tracer,
    tracer_initialiser as tracer_initialiser,
    TRACER_NEEDS_AVAL_SLOT as TRACER_NEEDS_AVAL_SLOT,
    TRACER_TAKES_AVAL as TRACER_TAKES_AVAL,
    TRACERS_ANSWER_CONCRETENESS as TRACERS_ANSWER_CONCRETENESS,
    tracking_varying_axes as tracking_varying_axes,
    TYPED_SCALAR_TYPES as TYPED_SCALAR_TYPES,
    typed_scalar_types_of as typed_scalar_types_of,
    without_mesh as without_mesh,
    WrappedFun as WrappedFun,
)
