"""`custom_jvp` and `custom_vjp` functions applied to Values.

JAX hands these to dedicated trace hooks with one-shot `WrappedFun`s rather than
jaxprs; `QuaxTrace`'s hooks dispatch them on `custom_jvp_call_p` and
`custom_vjp_call_p` with those functions as params, so a type may register its
own rule. The built-in rules, registered here for every type, build an
equivalent custom-derivative function over the Values' array leaves and bind it
at the parent trace, so the user's derivative rule runs whenever JAX would run
it, under any outer transformation:

- the primal runs the original function under `quaxify`;
- for `custom_jvp`, the rule runs under `quaxify` on the Values and their
  tangents: for a type with `Value.structured_tangents` (`materialise()` linear
  in the leaves) a tangent Value of the same type, for any other type the dense
  tangent of the array it stands for, and symbolic zeros where nothing is
  perturbed. A rule's tangent output that a Value output's leaves cannot carry
  makes that output dense (or raises, naming the type): never a different
  derivative;
- for `custom_vjp`, the user's `bwd` runs under `quaxify`; a cotangent for a
  Value input is pulled back to its leaves by the transpose of the derivative
  of `Value.dense_for_derivatives()` (`_leaf_derivatives.py`), which is correct
  for every type and never keeps the dense array.
"""

import contextvars
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jax_compat as jc
from .._diagnostics import messages, QuaxlikeError
from .._known_values import knowledge_of, sharing_knowledge
from .._quaxify import lifted_call
from .._rules import register, sub_program_rule
from .._values import checked_aval, materialise_value, Value
from ._common import AnyValue
from ._leaf_derivatives import dense_array, dense_tangent, leaf_cotangents


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


_SCALARS = (bool, int, float, complex, np.generic)


def _as_arrays(items) -> list:
    """`items` with NumPy and Python scalars as arrays. A plain output may be a
    scalar (a jaxpr's literal) in one computation and an array in another, and
    JAX hands derivative rules a Python number it differentiates at as a typed
    scalar: as arrays they are leaves everywhere (`eqx.is_array` is false for
    scalars)."""
    return [jnp.asarray(x) if isinstance(x, _SCALARS) else x for x in items]


class _Flattened:
    """The array leaves of a list of values (Values flattened), and the way back."""

    def __init__(self, values):
        values = _as_arrays(values)
        dynamic, self.static = eqx.partition(values, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(dynamic)
        # For each position, the slice of `leaves` it owns, and whether it is a Value.
        self.spans = []
        start = 0
        for item in dynamic:
            n = len(jtu.tree_leaves(item))
            self.spans.append((start, start + n))
            start += n
        self.is_value = [isinstance(v, Value) for v in values]
        self.types = [type(v) for v in values]

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


def _reusable(wrapped, avals):
    """Turn a one-shot `WrappedFun` over dense arrays into a function that can be
    called any number of times (traced once, lazily, to a jaxpr)."""
    cache = []

    def call(*xs):
        if not cache:
            cache.append(jax.make_jaxpr(wrapped.call_wrapped)(*map(_struct, avals)))
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
    outputs), and `symbolic_zeros`. Returns the list of outputs.

    Whenever JAX would call the function's derivative rule, the rule runs, on
    the Values (under `quaxify`) and their tangents: a tangent Value of the same
    type for a type with `structured_tangents`, the dense tangent of the array
    it stands for otherwise, and a symbolic zero (or a zero, for a rule without
    `symbolic_zeros`) where nothing is perturbed."""
    inputs = _Flattened(values)
    avals = _avals(values)
    primal_dense = _reusable(fun, avals)
    rule = _JvpRule(jvp, avals, symbolic_zeros)
    outputs: list[_Flattened] = []
    # JAX hands the function fresh tracers for the leaves: what was known
    # outside is known inside (`_known_values`).
    knowledge = knowledge_of(inputs.leaves)

    @jax.custom_jvp
    def leaf_function(*leaves):
        sharing_knowledge(leaves, knowledge)
        out = _Flattened(lifted_call(primal_dense, *inputs.rebuild(leaves)))
        outputs[:] = [out]
        out_knowledge[:] = [knowledge_of(out.leaves)]
        return out.take_leaves()

    def leaf_function_jvp(primals, tangents):
        sharing_knowledge(primals, knowledge)
        primals = _as_arrays(primals)
        primal_values = inputs.rebuild(primals)
        rule_tangents = [
            _rule_tangent(inputs, position, primals, tangents)
            for position in range(len(inputs.spans))
        ]
        primal_outs, tangent_outs = rule(primal_values, rule_tangents)
        pairs = [_output_pair(p, t) for p, t in zip(primal_outs, tangent_outs)]
        primal_out = _Flattened([p for p, _ in pairs])
        outputs[:] = [primal_out]
        out_knowledge[:] = [knowledge_of(primal_out.leaves)]
        p_leaves = primal_out.take_leaves()
        t_leaves = [t for _, leaf_tangents in pairs for t in leaf_tangents]
        return p_leaves, [
            t if _is_inexact(p) else _tangent_zeros_like(p) for p, t in zip(p_leaves, t_leaves)
        ]

    out_knowledge: list = [None]  # what is known of the outputs inside
    leaf_function.defjvp(leaf_function_jvp, symbolic_zeros=True)
    out_leaves = leaf_function(*inputs.take_leaves())
    sharing_knowledge(out_leaves, out_knowledge[0])  # the same values outside
    return list(outputs[0].rebuild(out_leaves))


def _is_symbolic_zero(t) -> bool:
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


def _instantiated(primal, tangent):
    """A tangent as an array: zeros (of the tangent dtype) for a symbolic zero."""
    return _zeros_like_leaf(primal) if _is_symbolic_zero(tangent) else tangent


def _rule_tangent(inputs: "_Flattened", position: int, primals, tangents):
    """The tangent a `custom_jvp` rule receives for input `position`, from the
    tangents JAX gives the leaves: `None` where none is perturbed; for a Value
    with `structured_tangents`, a Value of its type over the leaf tangents; for
    another Value, the dense tangent of the array it stands for."""
    start, stop = inputs.spans[position]
    if all(_is_symbolic_zero(t) for t in tangents[start:stop]):
        return None
    leaf_tangents = [_instantiated(p, t) for p, t in zip(primals[start:stop], tangents[start:stop])]
    if not inputs.is_value[position]:
        return leaf_tangents[0]
    value = inputs.rebuild(primals)[position]
    if getattr(type(value), "structured_tangents", True):
        return _Flattened([value]).rebuild_tangents(primals[start:stop], leaf_tangents)[0]
    return dense_tangent(value, leaf_tangents, jc.custom_jvp_call_p)


class _JvpRule:
    """JAX's one-shot `jvp` function for one `custom_jvp` binding, callable any
    number of times with Values: traced once to a jaxpr over dense arrays (with
    symbolic zeros where the first call's tangents were zero, if the function
    takes them), then evaluated under `quaxify`.

    **Arguments:**

    - `jvp`: JAX's `WrappedFun`, primals then tangents to primal then tangent
        outputs.
    - `avals`: the primal inputs' abstract values.
    - `symbolic_zeros`: whether `jvp` takes `SymbolicZero`s for zero tangents.
    """

    def __init__(self, jvp, avals, symbolic_zeros: bool):
        self.jvp, self.avals, self.symbolic_zeros = jvp, avals, symbolic_zeros
        self.traced = None  # (jaxpr, zero inputs, zero outputs)

    def _trace(self, zero_in: tuple[bool, ...]):
        tangent_avals = [a.to_tangent_aval() for a in self.avals]
        zero_out: list[bool] = []

        def flat(*args):
            primals, present = args[: len(self.avals)], iter(args[len(self.avals) :])
            tangents = [
                jax.custom_derivatives.SymbolicZero(aval) if zero else next(present)
                for aval, zero in zip(tangent_avals, zero_in)
            ]
            outs = self.jvp.call_wrapped(*primals, *tangents)
            n = len(outs) // 2
            zero_out[:] = [_is_symbolic_zero(t) for t in outs[n:]]
            return [*outs[:n], *(t for t in outs[n:] if not _is_symbolic_zero(t))]

        structs = [_struct(a) for a in self.avals]
        structs += [_struct(a) for a, zero in zip(tangent_avals, zero_in) if not zero]
        jaxpr = jax.make_jaxpr(flat)(*structs)
        self.traced = (jaxpr, zero_in, tuple(zero_out))

    def __call__(self, primal_values, tangents) -> tuple[list, list]:
        """`(primal outputs, tangent outputs)` of the rule at `primal_values`
        (Values or arrays) in the direction `tangents` (`None` for a zero);
        a tangent output is `None` where the rule gave a symbolic zero."""
        if self.traced is None:
            self._trace(tuple(self.symbolic_zeros and t is None for t in tangents))
        jaxpr, zero_in, zero_out = self.traced  # pyright: ignore[reportGeneralTypeIssues]
        present = []
        for aval, tangent, zero in zip(self.avals, tangents, zero_in):
            if zero and tangent is not None:
                raise QuaxlikeError(messages.CUSTOM_JVP_ZEROS_CHANGED)
            if not zero:
                present.append(_zeros_of(aval) if tangent is None else tangent)
        outs = lifted_call(jc.jaxpr_as_fun(jaxpr), *primal_values, *present)
        n = len(zero_out)
        given = iter(outs[n:])
        return list(outs[:n]), [None if zero else next(given) for zero in zero_out]


def _struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _zeros_of(aval):
    """A zero tangent for a primal of abstract value `aval`."""
    tangent_aval = aval.to_tangent_aval()
    if tangent_aval.dtype == jax.dtypes.float0:
        return np.zeros(tangent_aval.shape, jax.dtypes.float0)
    return jnp.zeros(tangent_aval.shape, tangent_aval.dtype)


def _output_pair(primal, tangent) -> tuple[Any, list]:
    """A rule's primal output, and the tangents of its array leaves, from the
    rule's tangent output (`None` for a zero).

    A Value output keeps its type where its leaves can carry the tangent: a zero
    tangent, or a tangent Value of the same structure for a type with
    `structured_tangents`. Otherwise the output becomes the array it stands for
    (through `materialise()`, which may refuse, naming `custom_jvp_call`), and a
    tangent Value the array it stands for too: never a different derivative."""
    if isinstance(tangent, Value) and not _same_kind(primal, tangent):
        tangent = dense_array(tangent, jc.custom_jvp_call_p)
    if isinstance(primal, Value):
        if tangent is None:
            return primal, [_zeros_like_leaf(x) for x in _Flattened([primal]).leaves]
        if isinstance(tangent, Value):  # of the same structure, structured_tangents
            return primal, _Flattened([tangent]).leaves
        primal = materialise_value(primal, jc.custom_jvp_call_p, fallback=True)
    if tangent is None:
        return primal, [_zeros_like_leaf(primal)]
    return primal, [tangent]


def _same_kind(primal, tangent) -> bool:
    """Whether the leaves of `tangent` (a Value) are the tangents of `primal`'s."""
    return (
        isinstance(primal, Value)
        and getattr(type(primal), "structured_tangents", True)
        and _Flattened([primal]).same_structure(_Flattened([tangent]))
    )


def _zeros_like_leaf(x):
    return jnp.zeros_like(x) if _is_inexact(x) else _tangent_zeros_like(x)


# Context variables that rules read, whose values at the forward pass its
# `bwd` runs with: JAX runs `bwd` later, when the forward's scopes have ended.
_carried_into_bwd: list[contextvars.ContextVar] = []


def carry_into_backward_passes(variable: contextvars.ContextVar) -> None:
    """Have a `custom_vjp`'s backward pass run with `variable` as it was when its
    forward pass was traced.

    A type whose rules read a setting from a context variable (set by a scope
    the user opens around the forward call) registers it here: JAX runs a
    `custom_vjp`'s `bwd` only when the derivative is taken, after that scope
    has ended, and its rules must decide as the forward's did.

    **Arguments:**

    - `variable`: a `contextvars.ContextVar` with a default.

    !!! example

        ```python
        import contextvars

        # A setting a type's rules read, given by a scope around the forward call.
        rounding = contextvars.ContextVar("my_type_rounding", default="nearest")
        quaxlike.internal.carry_into_backward_passes(rounding)
        ```
    """
    if variable not in _carried_into_bwd:
        _carried_into_bwd.append(variable)


def _forward_context() -> list:
    return [(variable, variable.get()) for variable in _carried_into_bwd]


def _in_forward_context(context: list, fn, *args):
    tokens = [variable.set(value) for variable, value in context]
    try:
        return fn(*args)
    finally:
        for (variable, _), token in zip(reversed(context), reversed(tokens)):
            variable.reset(token)


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
    knowledge = knowledge_of(inputs.leaves)  # as for `custom_jvp`
    forward_context = _forward_context()

    @jax.custom_vjp
    def leaf_function(*leaves):
        sharing_knowledge(leaves, knowledge)
        out = _Flattened(lifted_call(primal_dense, *inputs.rebuild(leaves)))
        outputs[:] = [out]
        out_knowledge[:] = [knowledge_of(out.leaves)]
        return out.take_leaves()

    def leaf_fwd(*primals):
        # Registered with symbolic zeros, so JAX says which leaves are perturbed;
        # a Value is perturbed when any of its leaves is.
        leaves = [p.value for p in primals]
        sharing_knowledge(leaves, knowledge)
        leaves = _as_arrays(leaves)
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
        out_knowledge[:] = [knowledge_of(out.leaves)]
        res_dynamic, static = eqx.partition(residuals, eqx.is_array)
        residual_static[:] = [static]
        out_leaves = out.take_leaves()
        return out_leaves, (res_dynamic, list(leaves), out_leaves)

    def leaf_bwd(saved, out_cts):
        res_dynamic, in_leaves, out_leaves = saved
        residuals = eqx.combine(res_dynamic, residual_static[0])
        _check_output_cotangents(outputs[0], out_cts)
        out_cts = [_instantiate(ct) for ct in out_cts]
        # Cotangents of Value outputs are rebuilt as Values of the same type
        # (checked above: types with `structured_tangents`, or zero).
        cts = outputs[0].rebuild_tangents(out_leaves, out_cts)
        cts = [
            primal.as_cotangent(ct) if isinstance(primal, Value) else ct
            for primal, ct in zip(outputs[0].rebuild(out_leaves), cts)
        ]
        in_cts = _in_forward_context(
            forward_context, lifted_call, _bwd_cotangents, bwd, *residuals, *cts
        )
        return tuple(_leaf_cotangents(inputs, in_leaves, in_cts, in_perturbed[0]))

    in_perturbed: list = []
    out_knowledge: list = [None]  # what is known of the outputs inside
    leaf_function.defvjp(leaf_fwd, leaf_bwd, symbolic_zeros=True)
    out_leaves = leaf_function(*inputs.take_leaves())
    sharing_knowledge(out_leaves, out_knowledge[0])  # the same values outside
    return list(outputs[0].rebuild(out_leaves))


def _bwd_cotangents(bwd, *args):
    return jc.custom_vjp_cotangents(bwd.call_wrapped(*args))


def _instantiate(ct):
    """A dense array for a symbolic-zero cotangent; others unchanged."""
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        # `SymbolicZero.__getattr__` forwards `dtype` to its aval.
        return jnp.zeros(ct.shape, ct.dtype)  # pyright: ignore[reportArgumentType]
    return ct


def _check_output_cotangents(outputs: "_Flattened", out_cts) -> None:
    """Raise where a Value output's leaves received a cotangent that the
    backward pass cannot be given: `bwd` takes the cotangent of the array an
    output stands for, which is the Value rebuilt over its leaves' cotangents
    only for a type with `structured_tangents`."""
    for (start, stop), is_value, cls in zip(outputs.spans, outputs.is_value, outputs.types):
        if not is_value or getattr(cls, "structured_tangents", True):
            continue
        if all(_is_symbolic_zero(ct) for ct in out_cts[start:stop]):
            continue
        raise QuaxlikeError(messages.CUSTOM_VJP_OUTPUT_COTANGENT.format(type_name=cls.__name__))


def _leafwise(value: Value, ct) -> Value | None:
    """Where the cotangent `ct` that `bwd` gave `value` is a Value that reads as
    the cotangents of `value`'s leaves (`Value.cotangent_leaves`: a Value of the
    same type and structure, for a type with `structured_tangents`, its array
    linear in its leaves, as Quax takes them), that Value of leaf cotangents;
    else `None`. (Exact where the array is an isometric image of the leaves,
    as for dense wrappers, units, named axes and symbolic zeros; such a type
    need not be able to materialise.)"""
    if not isinstance(ct, Value) or not getattr(type(value), "structured_tangents", True):
        return None
    leaf_cts = value.cotangent_leaves(ct)
    if leaf_cts is None or not _Flattened([value]).same_structure(_Flattened([leaf_cts])):
        return None
    return leaf_cts


def _leaf_cotangents(inputs: "_Flattened", in_leaves, in_cts, perturbed):
    """Cotangents for the input leaves, from the cotangents `bwd` gave the inputs
    (each the cotangent of the array an input stands for, an array or a Value).
    Inputs nothing differentiates get none (a Value that refuses to materialise
    is never pulled back needlessly)."""
    out: list = [None] * len(in_leaves)
    values = inputs.rebuild(in_leaves)
    for position, ((start, stop), is_value) in enumerate(zip(inputs.spans, inputs.is_value)):
        ct = in_cts[position]
        if ct is None or start == stop or not perturbed[position]:
            continue
        if is_value and (leaf_cts := _leafwise(values[position], ct)) is not None:
            out[start:stop] = _Flattened([leaf_cts]).leaves
            continue
        if isinstance(ct, Value):
            ct = dense_array(ct, jc.custom_vjp_call_p)
        if is_value:
            out[start:stop] = leaf_cotangents(values[position], ct, jc.custom_vjp_call_p)
        else:
            out[start] = ct
    return [
        ct if ct is not None and _is_inexact(leaf) else None for ct, leaf in zip(out, in_leaves)
    ]
