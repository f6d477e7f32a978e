"""Rules for the primitives Equinox defines for its libraries.

- *Primitives made by Equinox's `create_vprim`*: filter primitives such as
  lineax's `linear_solve` (whose operands are the array leaves of any PyTree, a
  Value among them one leaf), and the loop helpers' `maybe_set` (a buffer write). For each such primitive `P` a
  companion filter primitive is made once (`_companion`), whose operands are the
  Values' own array leaves; binding it at the parent trace keeps the Values
  structured, while its implementation, abstract evaluation, JVP and transpose
  rebuild the Values and run `P`'s own rules under `quaxify`. So running the
  implementation (a conjugate-gradient loop, say) keeps a LoRA or tridiagonal
  operator structured, and an outer `jax.grad` still uses `P`'s JVP and
  transpose rules rather than differentiating its implementation. Rules are
  given when a filter primitive is first applied to a Value (lineax makes its
  primitive when it is imported, perhaps after quaxlike).
- *Identities* that refuse a transformation (`nontraceable`,
  `nondifferentiable_backward`, `nonbatchable`) are applied to each array leaf
  of a Value, which keeps its type.
- `select_if_vmap(pred, x, y)` (`x`, or `lax.select(pred, x, y)` once batched):
  applied leaf by leaf when `x` and `y` are Values of one structure; otherwise
  `lax.select(pred, x, y)` runs under `quaxify`, so each type's `select_n` rule
  decides. Unbatched, Equinox's own rule returns `x` and takes `pred` to be
  true, as `lax.select` then does.

Where Equinox keeps these elsewhere, nothing is registered (the default rule
materialises, as before): see `_jax_compat/_equinox.py`.
"""

import weakref
from typing import Any

import equinox as eqx
import jax
import jax.interpreters.ad as ad
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from .. import _jax_compat as jc
from .._diagnostics import QuaxlikeError
from .._quaxify import lifted_call
from .._rules import add_rule_provider, register
from .._values import materialise_value, Value
from ._common import AnyValue, to_dense
from ._leaf_derivatives import dense_tangent


_VALUE_TANGENT_OUT = (
    "The JVP rule of `{primitive}` gave output {index} (a {type_name}) a dense "
    "tangent, which a {type_name}'s array leaves cannot carry: {type_name} declares "
    "`structured_tangents = False`. Differentiate with respect to the dense array "
    "instead, or give {type_name} a rule for `{primitive}`."
)
_LINEAR_VALUE_OPERAND = (
    "`{primitive}` is being transposed with respect to a {type_name} operand "
    "(a Value that is itself a linear input of the transposed program). quaxlike "
    "transposes `{primitive}` only with respect to its plain array operands; pass "
    "that operand as a plain array, or give {type_name} a rule for `{primitive}`."
)
_VALUE_COTANGENT_OUT = (
    "A cotangent for output {index} of `{primitive}` arrived as the array leaves of "
    "a {type_name}, which cannot be turned back into one dense cotangent: "
    "{type_name} declares `structured_tangents = False`. Give {type_name} a rule for "
    "`{primitive}`."
)


def _is_zero(t) -> bool:
    return t is None or type(t) is ad.Zero


def _zero_tangent(x):
    """An instantiated zero tangent for the array `x`."""
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _structured(value: Value) -> bool:
    return getattr(type(value), "structured_tangents", True)


# --- filter primitives -------------------------------------------------------


def _split(x) -> tuple[list, Any]:
    """`(arrays, layout)`: `[x]` and `None` for an array; for a Value, its array
    leaves and `(treedef, leaves with None where the arrays go, count)` (a
    flattened PyTree has no `None` leaves)."""
    if not isinstance(x, Value):
        return [x], None
    leaves, treedef = jtu.tree_flatten(x)
    arrays = [leaf for leaf in leaves if eqx.is_array(leaf)]
    holes = [None if eqx.is_array(leaf) else leaf for leaf in leaves]
    return arrays, (treedef, holes, len(arrays))


def _join(layout: list, arrays) -> list:
    """`_split`'s inverse over a list: the arrays (or anything standing in
    their places: tangents, cotangents) put back into Values."""
    arrays = iter(list(arrays))
    out = []
    for item in layout:
        if item is None:
            out.append(next(arrays))
            continue
        treedef, holes, count = item
        mine = iter([next(arrays) for _ in range(count)])
        out.append(jtu.tree_unflatten(treedef, [next(mine) if h is None else h for h in holes]))
    return out


def _flat(items) -> list:
    return [a for x in items for a in _split(x)[0]]


class _Layout:
    """How a filter primitive's operands and outputs (arrays and Values) lie
    among its companion's (arrays only: each Value replaced by its array
    leaves), with the primitive's own params. The companion's one param; the
    outputs' layout is recorded when the companion first runs or is evaluated
    abstractly."""

    __slots__ = ("params", "operands", "outputs", "output_avals", "expected", "__weakref__")

    def __init__(self, params: dict, operands):
        self.params = params
        self.operands = [_split(x)[1] for x in operands]
        self.outputs: list | None = None
        self.output_avals: list = []
        self.expected: list | None = None

    def record_outputs(self, outputs) -> list:
        if self.outputs is None:
            self.outputs = [_split(x)[1] for x in outputs]
            self.output_avals = [
                x.aval() if isinstance(x, Value) else jax.typeof(x) for x in outputs
            ]
        return _flat(outputs)


def _operand_tangent(x: Any, leaf_tangents: list, primitive) -> Any:
    """The tangent of the operand `x` for a primitive's own JVP rule, from the
    tangents of its array leaves (`ad.Zero` where zero): for a Value, a symbolic
    zero when all are zero; a Value of the same type when its tangents are
    structured; else the dense tangent (the JVP of `materialise()`)."""
    if not isinstance(x, Value):
        return leaf_tangents[0]
    if all(_is_zero(t) for t in leaf_tangents):
        return ad.Zero(x.aval().to_tangent_aval())
    return _value_tangent(x, leaf_tangents, primitive)


def _value_tangent(value: Value, leaf_tangents: list, primitive) -> Any:
    """The tangent of the Value `value` (not all of whose leaves' tangents are
    zero): a Value of its type holding the leaves' tangents where its tangents
    are structured, else the dense tangent of the array it stands for (the JVP of
    `dense_for_derivatives()`, which raises naming the type if it refuses)."""
    arrays, layout = _split(value)
    tangents = [_zero_tangent(a) if _is_zero(t) else t for a, t in zip(arrays, leaf_tangents)]
    if _structured(value):
        return _join([layout], tangents)[0]
    return dense_tangent(value, tangents, primitive)


def _tangents_out(primals_out: list, tangents_out: list, primitive) -> list:
    """The primitive's JVP rule's tangent outputs, as the companion's: a Value
    output's tangent is the array leaves of a Value of its type."""
    flat = []
    for index, (primal, tangent) in enumerate(zip(primals_out, tangents_out)):
        arrays = _split(primal)[0]
        if _is_zero(tangent):
            flat.extend(ad.Zero(jax.typeof(a).to_tangent_aval()) for a in arrays)
        elif not isinstance(primal, Value):
            flat.append(tangent)
        elif type(tangent) is type(primal) and _structured(primal):
            flat.extend(_split(tangent)[0])
        else:
            raise QuaxlikeError(
                _VALUE_TANGENT_OUT.format(
                    primitive=primitive.name, index=index, type_name=type(primal).__name__
                )
            )
    return flat


def _make_companion(primitive, impl, abstract_eval, jvp, transpose):
    """A filter primitive over the array leaves of `primitive`'s operands, whose
    rules run `primitive`'s own (`impl`, `jvp`, `transpose`) under `quaxify`.
    Its plain outputs have the weak types of `primitive`'s own abstract
    evaluation (`abstract_eval`), which the implementation may not keep."""

    def expected_avals(operands, layout: _Layout) -> list:
        if layout.expected is None:
            avals = [x.aval() if isinstance(x, Value) else jax.typeof(x) for x in operands]
            layout.expected = list(abstract_eval(*avals, **layout.params))
        return layout.expected

    def companion_impl(*arrays, layout: _Layout):
        operands = _join(layout.operands, arrays)
        outputs = lifted_call(lambda *ops: impl(*ops, **layout.params), *operands)
        outputs = [
            _strong_if(x, aval) for x, aval in zip(outputs, expected_avals(operands, layout))
        ]
        return layout.record_outputs(outputs)

    def companion_abstract_eval(*avals, layout: _Layout):
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        out = jax.eval_shape(lambda *xs: companion_impl(*xs, layout=layout), *structs)
        return [jc.ShapedArray(o.shape, o.dtype, weak_type=o.weak_type) for o in out]

    def companion_jvp(primals, tangents, *, layout: _Layout):
        operands = _join(layout.operands, primals)
        given = [
            _operand_tangent(x, group, primitive)
            for x, group in zip(operands, _group(layout.operands, tangents))
        ]
        primals_out, tangents_out = lifted_call(
            lambda ops, tans: jvp(ops, tans, **layout.params), operands, given
        )
        layout.record_outputs(primals_out)
        return _flat(primals_out), _tangents_out(primals_out, tangents_out, primitive)

    def companion_transpose(cts, *arrays, layout: _Layout):
        assert layout.outputs is not None
        operands = _join(layout.operands, arrays)
        for x in operands:
            if isinstance(x, Value) and any(map(ad.is_undefined_primal, _split(x)[0])):
                raise QuaxlikeError(
                    _LINEAR_VALUE_OPERAND.format(
                        primitive=primitive.name, type_name=type(x).__name__
                    )
                )
        cts_out = []
        for index, (item, ct) in enumerate(zip(layout.outputs, _group(layout.outputs, cts))):
            zero = ad.Zero(layout.output_avals[index].to_tangent_aval())
            if item is None:
                cts_out.append(zero if _is_zero(ct[0]) else ct[0])
            elif all(map(_is_zero, ct)):
                cts_out.append(zero)
            else:
                ct = [_instantiate(t) for t in ct]
                value = _join([item], ct)[0]
                if not _structured(value) or any(t is None for t in ct):
                    raise QuaxlikeError(
                        _VALUE_COTANGENT_OUT.format(
                            primitive=primitive.name, index=index, type_name=type(value).__name__
                        )
                    )
                cts_out.append(value)
        operand_cts = lifted_call(
            lambda c, ops: transpose(c, *ops, **layout.params), cts_out, operands
        )
        flat = []
        for x, ct in zip(operands, operand_cts):
            if isinstance(x, Value):
                flat.extend([None] * len(_split(x)[0]))
            elif _is_zero(ct) or ct is ad.Zero or not ad.is_undefined_primal(x):
                flat.append(None)
            elif isinstance(ct, Value):
                flat.append(materialise_value(ct, primitive, fallback=True))
            else:
                flat.append(ct)
        return flat

    return jc.create_vprim(
        f"quaxlike_{primitive.name}",
        companion_impl,
        companion_abstract_eval,
        companion_jvp,
        companion_transpose,
    )


def _strong_if(x, aval):
    """`x` without its weak type where the primitive's own abstract evaluation
    gives `aval` a strong one (a plain output only)."""
    if isinstance(x, Value) or getattr(aval, "weak_type", True):
        return x
    if not jax.typeof(x).weak_type:
        return x
    return lax.convert_element_type(x, aval.dtype)


def _instantiate(ct):
    if type(ct) is not ad.Zero:
        return ct
    aval: Any = ct.aval
    return jnp.zeros(aval.shape, aval.dtype)


def _group(layout: list, flat) -> list[list]:
    flat = iter(list(flat))
    return [[next(flat) for _ in range(1 if item is None else item[2])] for item in layout]


_companions: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _companion(primitive, rules) -> Any:
    companion = _companions.get(primitive)
    if companion is None:
        companion = _companions[primitive] = _make_companion(primitive, *rules)
    return companion


def _provide_filter_primitive_rule(primitive) -> None:
    rules = jc.filter_primitive_rules(primitive)
    if rules is None:
        return

    @register(primitive)
    def filter_primitive_values(*operands: AnyValue, **params):
        layout = _Layout(params, operands)
        outputs = _companion(primitive, rules).bind(*_flat(operands), layout=layout)
        assert layout.outputs is not None  # recorded by its impl or abstract evaluation
        return _join(layout.outputs, outputs)

    filter_primitive_values.__qualname__ = f"filter_primitive_values[{primitive.name}]"


add_rule_provider(_provide_filter_primitive_rule)


# --- identities and select_if_vmap ------------------------------------------


def _leafwise(primitive):
    def identity_values(x: Value, **params):
        dynamic, static = eqx.partition(x, eqx.is_array)
        dynamic = jtu.tree_map(lambda leaf: primitive.bind(leaf, **params), dynamic)
        return eqx.combine(dynamic, static)

    identity_values.__qualname__ = f"identity_values[{primitive.name}]"
    return identity_values


for _primitive in jc.leafwise_identity_primitives:
    register(_primitive)(_leafwise(_primitive))


def _same_structure(x, y) -> bool:
    (x_dynamic, x_static), (y_dynamic, y_static) = (eqx.partition(v, eqx.is_array) for v in (x, y))
    if jtu.tree_structure(x_dynamic) != jtu.tree_structure(y_dynamic):
        return False
    same_avals = all(
        jax.typeof(a) == jax.typeof(b)
        for a, b in zip(jtu.tree_leaves(x_dynamic), jtu.tree_leaves(y_dynamic))
    )
    return same_avals and bool(eqx.tree_equal(x_static, y_static))


if jc.select_if_vmap_p is not None:
    _select_if_vmap_p = jc.select_if_vmap_p

    @register(_select_if_vmap_p)
    def select_if_vmap_values(pred: AnyValue, x: AnyValue, y: AnyValue, **params):
        pred = to_dense(pred, _select_if_vmap_p)
        if isinstance(x, Value) and type(x) is type(y) and _same_structure(x, y):
            dynamic_x, static = eqx.partition(x, eqx.is_array)
            dynamic_y = eqx.filter(y, eqx.is_array)
            dynamic = jtu.tree_map(
                lambda a, b: _select_if_vmap_p.bind(pred, a, b, **params), dynamic_x, dynamic_y
            )
            return eqx.combine(dynamic, static)
        return lifted_call(lax.select, pred, x, y)
