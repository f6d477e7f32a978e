"""`custom_jvp` and `custom_vjp` functions applied to Values.

JAX hands these to dedicated trace hooks with one-shot `WrappedFun`s rather than
jaxprs; `QuaxTrace`'s hooks dispatch them on `custom_jvp_call_p` and
`custom_vjp_call_p` with those functions as params, so a type may register its
own rule. The built-in rules, registered here for every type, build an
equivalent custom-derivative function over the Values' array leaves and bind it
at the parent trace, so the user's derivative rule keeps working under any
outer transformation:

- the primal runs the original function under `quaxify`;
- for `custom_jvp`, tangents of a Value's leaves are treated as a Value of the same
  type (correct when `materialise()` is linear in the leaves, which is what
  `Value.structured_tangents` declares); otherwise, or when the rule's tangent
  output does not fit the primal output, we differentiate the primal itself;
- for `custom_vjp`, the user's `bwd` runs under `quaxify`; a dense cotangent for a
  Value input is pulled back to its leaves through `materialise()`, which is
  correct for every type.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jax_compat as jc
from .._quaxify import lifted_call
from .._rules import register, sub_program_rule
from .._values import checked_aval, materialise_value, Value
from ._common import AnyValue


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class _Flattened:
    """The array leaves of a list of values (Values flattened), and the way back."""

    def __init__(self, values):
        dynamic, self.static = eqx.partition(list(values), eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(dynamic)
        # For each position, the slice of `leaves` it owns, and whether it is a Value.
        self.spans = []
        start = 0
        for item in dynamic:
            n = len(jtu.tree_leaves(item))
            self.spans.append((start, start + n))
            start += n
        self.is_value = [isinstance(v, Value) for v in values]

    def same_structure(self, other: "_Flattened") -> bool:
        if self.treedef != other.treedef:
            return False
        a, b = jtu.tree_leaves(self.static), jtu.tree_leaves(other.static)
        try:
            return len(a) == len(b) and all(x is y or bool(x == y) for x, y in zip(a, b))
        except Exception:
            return False

    def take_leaves(self) -> list:
        """Hand the leaves over and forget them, so that this object (kept alive by
        JAX in the closures of custom rules) holds no tracers."""
        leaves, self.leaves = self.leaves, []
        return leaves

    def rebuild(self, leaves):
        return eqx.combine(jtu.tree_unflatten(self.treedef, list(leaves)), self.static)

    def rebuild_tangents(self, primal_leaves, tangent_leaves):
        # Inside a Value, a non-differentiable leaf (integer indices, ...) keeps its
        # primal value: the tangent Value has the same structure as the primal one.
        leaves = list(tangent_leaves)
        for (start, stop), is_value in zip(self.spans, self.is_value):
            if is_value:
                for k in range(start, stop):
                    if not _is_inexact(primal_leaves[k]):
                        leaves[k] = primal_leaves[k]
        return self.rebuild(leaves)


def _reusable(wrapped, avals, *, interleave_true: bool = False):
    """Turn a one-shot `WrappedFun` over dense arrays into a function that can be
    called any number of times (traced once, lazily, to a jaxpr)."""
    cache = []

    def call(*xs):
        if not cache:

            def flat(*ys):
                if interleave_true:
                    ys = [z for y in ys for z in (y, True)]
                return wrapped.call_wrapped(*ys)

            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
            cache.append(jax.make_jaxpr(flat)(*structs))
        return jc.jaxpr_as_fun(cache[0])(*xs)

    return call


def _avals(values):
    return [checked_aval(v) if isinstance(v, Value) else jax.typeof(v) for v in values]


def _tangent_zeros_like(x):
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _primal_sub_program(params) -> tuple:
    # An equation's params hold the primal as a jaxpr: eagerly (no derivative is
    # ever taken) the call computes that jaxpr, which the verdict of an
    # enclosing `jit` looks into (see `_sub_programs.only_materialises`). Never
    # run in place: the rule keeps the custom derivative.
    return jc.custom_call_primal_jaxpr(params), False


@register(jc.custom_jvp_call_p)
@sub_program_rule(_primal_sub_program)
def custom_jvp_call_p_values(*values: AnyValue, fun, jvp, symbolic_zeros: bool, **params):
    """The built-in rule for a `custom_jvp` function applied to Values. Its
    params are `fun` and `jvp`, JAX's one-shot `WrappedFun`s over dense arrays
    (`jvp` takes primals then tangents and returns primal then tangent
    outputs), and `symbolic_zeros`. Returns the list of outputs."""
    inputs = _Flattened(values)
    avals = _avals(values)
    primal_dense = _reusable(fun, avals)
    outputs: list[_Flattened] = []

    def primal_leaves(*leaves):
        out = _Flattened(lifted_call(primal_dense, *inputs.rebuild(leaves)))
        outputs[:] = [out]
        return out.take_leaves()

    structured = not symbolic_zeros and all(
        getattr(type(v), "structured_tangents", True) for v in values if isinstance(v, Value)
    )
    jvp_dense = _reusable(jvp, [*avals, *(a.to_tangent_aval() for a in avals)])

    @jax.custom_jvp
    def leaf_function(*leaves):
        return primal_leaves(*leaves)

    @leaf_function.defjvp
    def leaf_function_jvp(primals, tangents):
        if structured:
            primal_values = inputs.rebuild(primals)
            tangent_values = inputs.rebuild_tangents(primals, tangents)
            outs = lifted_call(jvp_dense, *primal_values, *tangent_values)
            n = len(outs) // 2
            primal_out = _Flattened([_primal_like(p, t) for p, t in zip(outs[:n], outs[n:])])
            tangent_out = _Flattened([_tangent_like(p, t) for p, t in zip(outs[:n], outs[n:])])
            if primal_out.same_structure(tangent_out):
                outputs[:] = [primal_out]
                p_leaves, t_leaves = primal_out.take_leaves(), tangent_out.take_leaves()
                tangent_leaves = [
                    t if _is_inexact(p) else _tangent_zeros_like(p)
                    for p, t in zip(p_leaves, t_leaves)
                ]
                return p_leaves, tangent_leaves
            # The rule's tangents do not fit its primal outputs. JAX lets a
            # custom_jvp binding call either the function or its rule, never both
            # (each records its output structure), so differentiate the primal
            # computation the rule itself performed.
            return jax.jvp(rule_primal_leaves, tuple(primals), tuple(tangents))
        # Differentiate the primal computation itself.
        return jax.jvp(primal_leaves, tuple(primals), tuple(tangents))

    def rule_primal_leaves(*leaves):
        zeros = [jnp.zeros_like(x) if _is_inexact(x) else _tangent_zeros_like(x) for x in leaves]
        outs = lifted_call(
            jvp_dense, *inputs.rebuild(leaves), *inputs.rebuild_tangents(leaves, zeros)
        )
        out = _Flattened(outs[: len(outs) // 2])
        outputs[:] = [out]
        return out.take_leaves()

    out_leaves = leaf_function(*inputs.take_leaves())
    return list(outputs[0].rebuild(out_leaves))


def _primal_like(primal, tangent):
    """A rule's primal output in the form its tangent output can take: a Value
    whose tangent the rule built as a plain array (JAX's own rules make some
    tangents from scratch, such as `zeros_like` of an output) is materialised,
    since a plain tangent cannot carry the Value's structure. (Differentiating
    the rule's own primal computation instead never ends for a rule that calls
    the function it differentiates, as `jnp.linalg.slogdet`'s does.)"""
    if isinstance(primal, Value) and not isinstance(tangent, Value):
        return materialise_value(primal, jc.custom_jvp_call_p, fallback=True)
    return primal


def _tangent_like(primal, tangent):
    """A rule's tangent output in the form of its primal output: a Value tangent
    of a plain array output is materialised (tangents of Values with
    `structured_tangents` are linear in their leaves, so this is exact)."""
    if isinstance(tangent, Value) and not isinstance(primal, Value):
        return materialise_value(tangent)
    return tangent


@register(jc.custom_vjp_call_p)
@sub_program_rule(_primal_sub_program)
def custom_vjp_call_p_values(
    *values: AnyValue, fun, fwd, bwd, out_trees, symbolic_zeros: bool, **params
):
    """The built-in rule for a `custom_vjp` function applied to Values. Its
    params are JAX's: `fun`, `fwd` and `bwd` (one-shot `WrappedFun`s over dense
    arrays), `out_trees` (a thunk, valid once `fwd` has run) and
    `symbolic_zeros`. Returns the list of outputs."""
    inputs = _Flattened(values)
    primal_dense = _reusable(fun, _avals(values))
    outputs: list[_Flattened] = []
    residual_static: list = []

    @jax.custom_vjp
    def leaf_function(*leaves):
        out = _Flattened(lifted_call(primal_dense, *inputs.rebuild(leaves)))
        outputs[:] = [out]
        return out.take_leaves()

    def leaf_fwd(*primals):
        # Registered with symbolic zeros, so JAX says which leaves are perturbed;
        # a Value is perturbed when any of its leaves is.
        leaves = [p.value for p in primals]
        perturbed = [any(p.perturbed for p in primals[a:b]) for a, b in inputs.spans]
        in_perturbed[:] = [perturbed]
        in_values = inputs.rebuild(leaves)

        def call_fwd(*v):
            return fwd.call_wrapped(*[z for pair in zip(v, perturbed) for z in pair])

        outs = lifted_call(call_fwd, *in_values)
        _, res_tree, input_fwds = out_trees()
        num_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out = iter(outs[:num_res_out])
        residuals = [next(res_out) if f is None else in_values[f] for f in input_fwds]
        out = _Flattened(outs[num_res_out:])
        outputs[:] = [out]
        res_dynamic, static = eqx.partition(residuals, eqx.is_array)
        residual_static[:] = [static]
        out_leaves = out.take_leaves()
        return out_leaves, (res_dynamic, list(leaves), out_leaves)

    def leaf_bwd(saved, out_cts):
        res_dynamic, in_leaves, out_leaves = saved
        residuals = eqx.combine(res_dynamic, residual_static[0])
        out_cts = [_instantiate(ct) for ct in out_cts]
        # Cotangents of Value outputs are rebuilt as Values of the same type.
        cts = outputs[0].rebuild_tangents(out_leaves, out_cts)
        in_cts = lifted_call(_bwd_cotangents, bwd, *residuals, *cts)
        return tuple(_leaf_cotangents(inputs, in_leaves, in_cts, in_perturbed[0]))

    in_perturbed: list = []
    leaf_function.defvjp(leaf_fwd, leaf_bwd, symbolic_zeros=True)
    out_leaves = leaf_function(*inputs.take_leaves())
    return list(outputs[0].rebuild(out_leaves))


def _bwd_cotangents(bwd, *args):
    return jc.custom_vjp_cotangents(bwd.call_wrapped(*args))


def _instantiate(ct):
    """A dense array for a symbolic-zero cotangent; others unchanged."""
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        # `SymbolicZero.__getattr__` forwards `dtype` to its aval.
        return jnp.zeros(ct.shape, ct.dtype)  # pyright: ignore[reportArgumentType]
    return ct


def _leaf_cotangents(inputs: "_Flattened", in_leaves, in_cts, perturbed):
    """Cotangents for the input leaves, from the cotangents `bwd` gave the inputs.
    Inputs nothing differentiates get none (a Value that refuses to materialise
    is never pulled back through `materialise()` needlessly)."""
    out = [None] * len(in_leaves)
    values = inputs.rebuild(in_leaves)
    for position, ((start, stop), is_value) in enumerate(zip(inputs.spans, inputs.is_value)):
        ct = in_cts[position]
        if ct is None or start == stop or not perturbed[position]:
            continue
        if not is_value:
            out[start] = materialise_value(ct) if isinstance(ct, Value) else ct
            continue
        value = values[position]
        if isinstance(ct, Value) and jtu.tree_structure(ct) == jtu.tree_structure(value):
            out[start:stop] = _Flattened([ct]).leaves
            continue
        # A dense cotangent: pull it back to the leaves through `materialise()`.
        dense_ct = materialise_value(ct) if isinstance(ct, Value) else ct
        single = _Flattened([value])
        _, pullback = jax.vjp(
            lambda *ls: materialise_value(single.rebuild(ls)[0]), *in_leaves[start:stop]
        )
        out[start:stop] = pullback(dense_ct)
    return [
        ct if ct is not None and _is_inexact(leaf) else None for ct, leaf in zip(out, in_leaves)
    ]
