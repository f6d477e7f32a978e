"""Primitives the conformance table does not reach, each with the reason.

A key ending in "." is a module prefix: it excludes every primitive all of whose
locations (`module.attribute`) lie under it and that no row reaches. Any other key
is one location.
Checked against jax 0.10.2 on CPU; the coverage test fails when a key matches
nothing (so this list cannot go stale silently) or when the table starts covering
an excluded primitive.
"""

# Locations that only re-export primitives defined elsewhere.
IGNORED_LOCATIONS = ("jax._src.internal_test_util.",)

_KERNEL = "kernel-language primitive: only valid inside a Pallas/Mosaic kernel body, which quaxify does not enter"
_GPU = "cuDNN custom call: GPU-only, no CPU lowering"
_ASYNC = "asynchronous collective start/done pair: bound only by jax._src.lax.parallel.*_start inside shard_map, no public API"
_REDUCED = "explicit-sharding reduced/unreduced axes: needs a multi-device mesh with unreduced specs, no jax.lax/numpy/nn entry point"
_INTERNAL = "internal to a JAX transformation: bound below a public primitive, never by user code"
_HIJAX = (
    "experimental hijax types (boxes, logs, hi-primitives): not reachable from jax.lax/numpy/nn"
)
_STATE = "state-discharge machinery used by Pallas kernels and run_state; user code reaches refs via jax.new_ref (covered)"
_SHAPE_POLY = "shape polymorphism in jax.export lowering: only appears with symbolic dimensions"

EXCLUDED: dict[str, str] = {
    # Kernel languages and accelerator-only custom calls.
    "jax._src.pallas.": _KERNEL,
    "jax._src.cudnn.": _GPU,
    "jax._src.tpu_custom_call.tpu_custom_call_p": "TPU-only Mosaic custom call",
    # Collectives that cannot run on a one-device CPU setup.
    "jax._src.lax.parallel.pbroadcast_p": (
        "no CPU lowering in jax 0.10.2 (MLIR translation rule for 'pbroadcast' not found "
        "for platform cpu), and its vmap rule fails in plain JAX"
    ),
    "jax._src.lax.parallel.ragged_all_to_all_p": (
        "XLA:CPU does not implement ragged-all-to-all, and it has no vmap rule"
    ),
    "jax._src.lax.parallel.psend_p": "psend/precv fail in plain JAX on CPU (AbstractToken has no 'mat')",
    "jax._src.lax.parallel.precv_p": "psend/precv fail in plain JAX on CPU (AbstractToken has no 'mat')",
    "jax._src.lax.parallel.all_gather_invariant_p": "only from jax._src.lax.parallel.all_gather_invariant (private), inside shard_map",
    "jax._src.lax.parallel.all_gather_start_p": _ASYNC,
    "jax._src.lax.parallel.all_gather_done_p": _ASYNC,
    "jax._src.lax.parallel.all_gather_reduced_start_p": _ASYNC,
    "jax._src.lax.parallel.all_to_all_start_p": _ASYNC,
    "jax._src.lax.parallel.all_to_all_done_p": _ASYNC,
    "jax._src.lax.parallel.ppermute_start_p": _ASYNC,
    # ppermute_done_p is only reachable as the module's leftover loop variable `p`.
    "jax._src.lax.parallel.p": _ASYNC,
    "jax._src.lax.parallel.pbroadcast_start_p": _ASYNC,
    "jax._src.lax.parallel.pbroadcast_done_p": _ASYNC,
    "jax._src.lax.parallel.psum_start_p": _ASYNC,
    "jax._src.lax.parallel.psum_done_p": _ASYNC,
    "jax._src.lax.parallel.psum_invariant_start_p": _ASYNC,
    "jax._src.lax.parallel.reduce_scatter_start_p": _ASYNC,
    "jax._src.lax.parallel.reduce_scatter_done_p": _ASYNC,
    "jax._src.lax.parallel.unreduced_psum_start_p": _ASYNC,
    "jax._src.lax.parallel.unreduced_reduce_scatter_start_p": _ASYNC,
    "jax._src.lax.parallel.all_gather_reduced_p": _REDUCED,
    "jax._src.lax.parallel.preduced_p": _REDUCED,
    "jax._src.lax.parallel.unreduced_psum_p": _REDUCED,
    "jax._src.lax.parallel.unreduced_reduce_scatter_p": _REDUCED,
    "jax._src.lax.parallel.vary_unreduced_cast_p": _REDUCED,
    "jax._src.core.reduced_vary_cast_p": _REDUCED,
    # Bound only inside JAX's own machinery.
    "jax._src.core.stage_p": (
        "binds through Trace.stage_value, never as an equation; exercised by the row 'stage'"
    ),
    "jax._src.ad_util.zeros_like_p": _INTERNAL + " (symbolic-zero instantiation in AD)",
    "jax._src.interpreters.ad.custom_lin_p": _INTERNAL + " (linearize of custom_vjp)",
    "jax._src.custom_derivatives.custom_jvp_call_jaxpr_p": _INTERNAL
    + " (legacy custom_jvp staging)",
    "jax._src.custom_derivatives.remat_opt_p": _INTERNAL + " (optimize_remat of custom_vjp)",
    "jax._src.custom_derivatives.unreachable_p": _INTERNAL
    + " (placeholder for DCE'd custom_vjp outputs)",
    "jax._src.lax.control_flow.loops.eval_jaxpr_p": _INTERNAL + " (scan's eager implementation)",
    "jax._src.lax.lax.tie_p": _INTERNAL + " (no binding site in jax 0.10.2 outside its own rules)",
    "jax._src.lax.lax.to_edtype_p": _INTERNAL + " (extended-dtype conversions)",
    "jax._src.lax.lax.from_edtype_p": _INTERNAL + " (extended-dtype conversions)",
    "jax._src.lax.lax.empty2_p": _INTERNAL + " (uninitialised buffers for refs)",
    "jax._src.core.accum_grad_in_ref_p": _INTERNAL + " (gradient accumulation into refs)",
    "jax._src.ad_checkpoint.call_hi_primitive_p": _HIJAX,
    "jax._src.hijax.": _HIJAX,
    "jax._src.state.": _STATE,
    "jax._src.export.shape_poly.": _SHAPE_POLY,
    # Need something the test environment cannot provide.
    "jax._src.ffi.ffi_call_p": "needs a registered XLA FFI target (C++); there is none to call from a pure-Python test",
    "jax._src.compute_on.compute_on_p": "host compute offloading: compute_on2 fails in plain JAX on CPU (AssertionError)",
}
