"""Known bugs the conformance suite found, as xfail reasons.

Each "core:" entry has a minimal reproduction in test_conformance.py (the test
named in it) and marks the table rows it breaks; "jax:" entries are JAX's own.
The marks are strict, so a fix makes them fail until the mark is removed.
"""

CUSTOM_JVP_BOTH_STORES = (
    "core: under an outer grad, a custom_jvp whose primal output is a plain array "
    "but whose jvp rule returns a Value tangent falls back to differentiating the "
    "primal after already calling the jvp rule: JAX raises StoreException: both "
    "stores occupied (see test_conformance.test_core_custom_jvp_mismatch_under_grad)"
)

REF_OUTPUT = (
    "core: a rule or default that returns a mutable reference (`jax.new_ref` on a "
    "materialised Value) has it converted with jnp.asarray, which indexes the Ref "
    "out of bounds (see test_conformance.test_core_default_returning_a_ref)"
)

UNCONSTRAINED_SPEC = (
    "core: the sharding_constraint rule looks every PartitionSpec entry up in the mesh, "
    "so P.UNCONSTRAINED (which vmap's batching rule inserts) raises KeyError "
    "(see test_conformance.test_core_sharding_constraint_unconstrained)"
)

BATCHED_WHILE_PREDICATE = (
    "core: the while rule re-binds through lax.while_loop, which demands a scalar "
    "predicate; vmap inside quaxify produces a while whose cond returns one boolean per "
    "batch element (see test_conformance.test_core_vmap_of_while_inside_quaxify)"
)

DCE_SINK_BATCHING = (
    "jax: dce_sink's batching rule returns one output where its abstract evaluation "
    "gives none; plain JAX drops it, quaxlike's checked mode (QUAXLIKE_CHECK=1) rejects it"
)
