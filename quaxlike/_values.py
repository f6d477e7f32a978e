"""The base classes users subclass: `Value` and `ArrayValue`."""

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np
from jaxtyping import ArrayLike

from . import _instrument, _jax_compat as jc, _policy
from ._diagnostics import MaterialisationError, messages, QuaxlikeError


class Value(eqx.Module):
    """Base class for every type that stands in for a JAX value inside `quaxify`.

    A `Value` is an Equinox Module, so it is a PyTree: `jax.jit`, `eqx.tree_at`
    and optax all see its fields. Subclasses describe what they stand for with
    `aval()` and how to become an ordinary array with `materialise()`; rules
    registered with `quaxlike.register` say what each primitive does with them.

    A subclass may also override the static method `default` to take over every
    primitive that has no rule for it (for example to raise, or to materialise in a
    special way).

    The class attribute `structured_tangents` (default `True`) says whether a
    tangent of this type's array leaves is itself a valid Value of the same type:
    true when `materialise()` is linear in the leaves (symbolic zeros, units,
    sparse data, named axes). `custom_jvp` rules then receive tangent Values of
    this type. Set it to `False` for types like LoRA (`W + A @ B` is bilinear in
    `A`, `B`); a `custom_jvp` rule then receives the tangent of the array the
    Value stands for as an ordinary array, the derivative of
    `dense_for_derivatives()` (see there). Either way the rule runs, as it would
    on the dense arrays.

    The class attribute `warn_on_materialise` (default `True`) says whether
    `quaxlike.materialise_policy("warn")`/`("error")` apply to this type; set it
    to `False` for types that are cheap and expected to become dense.

    The class attribute `compile_eagerly` (default `False`) is an opt-in for
    speed in eager code. Outside any transformation, a `jax.numpy` function
    applied to a Value runs operation by operation, as in Quax: rules receive
    concrete arrays, and results are those of running each rule as it is
    reached. (Where every operation on the Values would only materialise them,
    the call runs as JAX runs it on the dense arrays, which is the same thing.)
    With `compile_eagerly = True` on every Value type involved, such a call runs
    instead as one cached, compiled call: much faster, but the rules then see
    tracers, not concrete arrays, and XLA may fuse their operations with the
    function's (which can change the last bits of floating-point results).

    The class attribute `concrete_eagerly` (default `False`) says whether,
    outside any `jit`, a Value of this type answers JAX's questions for a
    concrete value (`x.item()`, `bool(x)`, `jnp.unique`, `jnp.trim_zeros`, a
    boolean mask) with its materialised array, as JAX's own tracers answer
    with the array they carry; under `jit` JAX's own error is raised, as for a
    plain array. It is off by default because JAX also asks in passing, on
    ordinary operations (dtype promotion asks every operand), and answering
    means materialising: worth it where that is free (`DenseArrayValue`).

    The class attribute `tracks_known_values` (default `False`) asks quaxlike to
    note, while a Value of this type is lifted, which plain arrays are constants
    in disguise under `jit` (`quaxlike.internal.known_value`,
    `is_scale_invariant`): `Unitful` lets a known 0, inf or NaN stand beside
    any quantity. Rules of other types never pay for it.

    Unlike other Equinox Modules, a Value's bound methods (`value.materialise`)
    are ordinary Python bound methods, not PyTrees: rules call them on every
    primitive, and Equinox's PyTree bound methods cost tens of microseconds
    each. Pass the Value itself to transformations, not its bound methods.

    Most types stand for an array and subclass `ArrayValue` instead, which adds
    `shape`, `dtype`, `ndim` and `size`.

    **Arguments:**

    None of its own. A subclass declares its fields as an Equinox Module does
    (array fields are PyTree leaves, `eqx.field(static=True)` fields are not), and
    those fields are its constructor's arguments.

    !!! example

        ```python
        class Scaled(quaxlike.Value):
            # stands for `factor * array`; no rules, so every primitive
            # falls back to materialising
            array: jax.Array
            factor: float = eqx.field(static=True)

            def aval(self):
                return jax.core.ShapedArray(self.array.shape, self.array.dtype)

            def materialise(self):
                return self.factor * self.array

        x = jnp.arange(3.0)
        out = quaxlike.quaxify(jnp.sin)(Scaled(x, 2.0))
        assert jnp.allclose(out, jnp.sin(2.0 * x))
        ```
    """

    structured_tangents: ClassVar[bool] = True
    warn_on_materialise: ClassVar[bool] = True
    compile_eagerly: ClassVar[bool] = False
    concrete_eagerly: ClassVar[bool] = False
    tracks_known_values: ClassVar[bool] = False

    # Equinox looks every attribute of a Module up through a Python-level
    # `__getattribute__` that turns methods into bound-method Modules (PyTrees),
    # at tens of microseconds per method access. Rules read fields and call
    # methods of Values on every primitive they handle, so Values use Python's
    # own lookup: fields and methods behave as on any object, and a Value's
    # bound method is an ordinary bound method rather than a PyTree.
    __getattribute__ = object.__getattribute__

    @abc.abstractmethod
    def aval(self) -> jc.AbstractValue:
        """The abstract value (usually a `jax.core.ShapedArray`) this Value stands for.

        It is computed once when the Value enters a `quaxify` trace. It should only
        read shapes and dtypes, and never add operations to a traced program.

        **Returns:**

        A `jax.core.AbstractValue`, usually
        `quaxlike.internal.ShapedArray(shape, dtype)`.
        """

    @abc.abstractmethod
    def materialise(self) -> Any:
        """Build the ordinary array this Value stands for.

        Called when a primitive has no rule for this type. Types that must never
        become dense should raise here, naming the type.

        **Returns:**

        An array whose shape and dtype are those of `aval()` (quaxlike checks). It
        may also be another Value, which is materialised in turn.
        """

    @staticmethod
    def default(
        primitive: jc.Primitive,
        values: Sequence["ArrayLike | Value"],
        params: dict[str, Any],
    ) -> "ArrayLike | Value | Sequence[ArrayLike | Value]":
        """The fallback for a primitive that has no rule for these argument types.

        The base implementation materialises every Value and binds the primitive on
        the results. Override it (as a `@staticmethod`) to change that for a type.

        **Arguments:**

        - `primitive`: the JAX primitive being applied.
        - `values`: its positional arguments; Values and ordinary arrays.
        - `params`: the primitive's parameters.

        **Returns:**

        What `primitive.bind` would return: one result, or a list of them for a
        primitive with `multiple_results`.

        !!! example

            ```python
            class Loud(quaxlike.ArrayValue):
                # refuses every primitive it has no rule for, naming it
                array: jax.Array

                def aval(self):
                    return jax.core.ShapedArray(self.array.shape, self.array.dtype)

                def materialise(self):
                    return self.array

                @staticmethod
                def default(primitive, values, params):
                    raise NotImplementedError(f"Loud has no rule for `{primitive.name}`")

            try:
                quaxlike.quaxify(jnp.sin)(Loud(jnp.ones(2)))
            except NotImplementedError as error:
                print(error)  # Loud has no rule for `sin`
            ```
        """
        arrays = [
            materialise_value(v, primitive, fallback=True, operands=values)
            if isinstance(v, Value)
            else v
            for v in values
        ]
        return primitive.bind(*arrays, **params)

    def dense_for_derivatives(self) -> Any:
        """The array this Value stands for, as a differentiable function of its
        leaves, for derivatives only.

        quaxlike differentiates it where a derivative must pass between the
        Value's leaves and the array it stands for: the tangent handed to a
        `custom_jvp` rule for a type without `structured_tangents`, and the
        pull-back of a dense cotangent that a `custom_vjp` backward pass gives a
        Value. The derivative is computed inside `jax.jit`, where XLA drops the
        dense array itself: only its tangent or the leaves' cotangents are kept.

        The base implementation calls `materialise()`. A type whose
        `materialise()` refuses to build the dense array (to save memory), while
        its derivatives are well defined, overrides this to build it anyway: LoRA
        does, so that a cotangent pulls back to `A` and `B` as `ct @ B.T` and
        `A.T @ ct` without `W + A @ B` ever being kept. A type that cannot carry a
        derivative should raise here, naming itself.

        **Returns:**

        An array of this Value's shape and dtype, computed from its leaves.
        """
        return self.materialise()

    def as_cotangent(self, leaf_cotangents: "Value") -> "Value":
        """The cotangent of the array this Value stands for, from `leaf_cotangents`
        (a Value of this one's structure holding the cotangents of its leaves),
        as a `custom_vjp`'s backward pass receives it; `cotangent_leaves` is the
        inverse. The base implementation returns `leaf_cotangents`: right for a
        type with `structured_tangents` whose array is its leaves in another
        form. `Unitful` overrides both: the cotangent of a quantity in `m` is
        in `1/m`."""
        return leaf_cotangents

    def cotangent_leaves(self, cotangent: "Value") -> "Value | None":
        """The inverse of `as_cotangent`: a Value of this one's structure holding
        the cotangents of its leaves, from the `cotangent` that a backward pass
        gave this Value, or `None` if it is not of that form (it is then pulled
        back through `dense_for_derivatives`). The base implementation accepts
        a Value of the same type (quaxlike then checks its structure)."""
        return cotangent if type(cotangent) is type(self) else None

    def joinable_form(self) -> "Value":
        """The form this Value takes where it meets a plain array: a loop carry
        that enters the loop as a plain array and leaves the body as this Value
        (or the reverse), or a `cond` output that is this Value in one branch and
        a plain array in another. Both sides must then be one type with one PyTree
        structure; quaxlike gives this form on one side and `holding_plain` on the
        other, instead of materialising this Value.

        The base implementation returns `self`. A type whose static fields mean
        something about derivatives changes them here, keeping the same array
        and the same derivatives: LoRA puts a frozen `W` behind
        `lax.stop_gradient` and turns the flag off, so that the plain array held
        in `W` on the other side keeps its derivative.

        **Returns:**

        A Value of the same type, standing for the same array.
        """
        return self

    def holding_plain(self, array: Any) -> "Value | None":
        """A Value with this one's type, PyTree structure and static fields that
        stands for exactly the plain `array` (of this Value's shape and dtype),
        or `None` when this type cannot hold it exactly.

        quaxlike calls it on `joinable_form()` (with abstract leaves,
        `jax.ShapeDtypeStruct`s: use only their shapes and dtypes) where a plain
        array meets a Value (see `joinable_form`). A loop state that starts as
        `jnp.zeros` where the loop's body puts a Value is the common case: with
        an answer, the carry keeps its type and nothing is materialised; with
        `None` (the base implementation), the Value is materialised there as
        before, or refuses to be.

        **Arguments:**

        - `array`: the plain array (a traced one, usually).

        **Returns:**

        The Value, or `None`.
        """
        return None

    def stand_in_for_plain(self, array: Any) -> "Value | None":
        """A Value of this type that a plain loop carry enters the body as while
        the loop rule works out the carry's type, or `None` (the base
        implementation).

        A body may refuse a plain carry it would accept as this type: `Unitful`
        refuses a solver's buffer that starts as plain `inf` and is filled with
        metres, since inside the body its value is no longer known. When the body
        raises an error of ours, quaxlike traces it again with each plain carry
        replaced by a stand-in one of the loop's Values offers, and drops that
        trace's results. A carry the body returns as a Value of another structure
        (in metres) is then joined (`holding_plain`) and the loop traced again
        with every check in force; one returned as the stand-in stays plain.
        Rounds repeat while they join something (a carry whose type follows from
        another's); else the body's error is raised.

        **Arguments:**

        - `array`: the plain carry as it enters the loop.

        **Returns:**

        The stand-in, or `None`.
        """
        return None

    def standing_in(self) -> bool:
        """Whether this Value was computed from a stand-in
        (`stand_in_for_plain`) and its type is still being worked out (a
        `Unitful` in a unit not yet known). Where such a Value meets another of
        its type in a nested loop's carry or a `cond`'s outputs, it is held like
        a plain array (`holding_plain(self)`) rather than materialised. The base
        implementation returns `False`.

        **Returns:**

        A bool.
        """
        return False


class ArrayValue(Value):
    """A `Value` that stands for an array: adds `shape`, `dtype`, `ndim` and `size`,
    all read from `aval()` (a subclass may override `shape`; `ndim` and `size`
    still follow `aval()`).

    This is the base class to use for a new type: subclass it, declare fields,
    and implement `aval()` and `materialise()`.

    **Arguments:**

    None of its own: a subclass's fields are its constructor's arguments, as for
    any Equinox Module.

    !!! example

        ```python
        class Ones(quaxlike.ArrayValue):
            shape_: tuple[int, ...] = eqx.field(static=True)

            def aval(self):
                return jax.core.ShapedArray(self.shape_, jnp.float32)

            def materialise(self):
                return jnp.ones(self.shape_, jnp.float32)

        ones = Ones((2, 3))
        assert ones.shape == (2, 3) and ones.ndim == 2 and ones.size == 6
        assert jnp.array_equal(quaxlike.quaxify(jnp.sum)(ones), 6.0)
        ```
    """

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array this Value stands for (from `aval()`)."""
        return self.aval().shape  # pyright: ignore

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the array this Value stands for (from `aval()`)."""
        return self.aval().dtype  # pyright: ignore

    # `ndim` and `size` read `aval()` rather than `self.shape`, as Quax's do: a
    # subclass may give `shape` a meaning of its own (a vector type whose
    # `shape` is its batch shape, while its aval has a component axis too).
    @property
    def ndim(self) -> int:
        """The number of dimensions of the array this Value stands for (from `aval()`)."""
        return len(self.aval().shape)  # pyright: ignore

    @property
    def size(self) -> int:
        """The number of elements of the array this Value stands for (from `aval()`)."""
        return int(np.prod(self.aval().shape))  # pyright: ignore


# `isinstance(x, Value)` goes through `ABCMeta.__instancecheck__` (about a
# microsecond); `is_value` runs on every PyTree node `quaxify` flattens, so it
# remembers the answer per type. Classes are never re-parented, so the answer
# for a type never changes (`register` on the ABC is not supported for Values).
_is_value_type: dict[type, bool] = {}


def is_value(x: Any) -> bool:
    """Whether `x` is a `Value` (a faster `isinstance(x, Value)`)."""
    cls = type(x)
    try:
        return _is_value_type[cls]
    except KeyError:
        answer = _is_value_type[cls] = isinstance(x, Value)
        return answer


def describe(x: Any) -> str:
    """`LoraArray[f32[4,3]]` for a Value, `f32[4,3]` for an array, the type's
    name for anything else."""
    if isinstance(x, Value):
        try:
            return f"{type(x).__qualname__}[{x.aval().str_short()}]"  # pyright: ignore
        except Exception:  # a broken aval() is reported elsewhere
            return type(x).__qualname__
    try:
        return jax.typeof(x).str_short()
    except TypeError:
        return type(x).__qualname__


def checked_aval(value: Value) -> jc.AbstractValue:
    """Call `value.aval()` and check it returned an abstract value."""
    aval = value.aval()
    if not isinstance(aval, jc.AbstractValue):
        raise QuaxlikeError(
            messages.BAD_AVAL.format(
                type_name=type(value).__qualname__, got=type(aval).__qualname__
            )
        )
    return aval


def materialise_value(
    value: Value,
    primitive: jc.Primitive | None = None,
    *,
    fallback: bool = False,
    operands: Sequence[Any] | None = None,
    aval: jc.AbstractValue | None = None,
) -> Any:
    """Materialise `value` until it is no longer a Value, checking the result
    has the shape and dtype that `aval()` promised.

    Use it in rules and tests rather than calling `value.materialise()` directly:
    it follows chains of Values (a `materialise()` that returns another Value) and
    raises a `quaxlike.QuaxlikeError` naming the type if the result disagrees with
    `aval()`. Called plainly, it does not consult `materialise_policy`: calling it
    is asking for the dense array on purpose.

    **Arguments:**

    - `value`: the Value to materialise.
    - `primitive`: the primitive that needs it, named in error messages
        (optional).
    - `fallback`: `True` when this is a fallback, because `primitive` has no
        rule for these types (quaxlike's own default and built-in rules pass
        it): the current `materialise_policy` then applies, `explain` records it,
        and a type whose `materialise()` raises gets a
        `quaxlike.MaterialisationError` that names `primitive` and shows the rule
        to register.
    - `operands`: all of `primitive`'s operands, for that rule's signature; `None`
        (the default) when a built-in rule, not a missing one, needs `value` dense
        (a loop carry whose type changed, say), which the error then says.
    - `aval`: `value.aval()`, when already known and checked.

    **Returns:**

    The ordinary array `value` stands for.

    !!! example

        ```python
        from quaxlike.symbolic.zero import Zero

        dense = quaxlike.internal.materialise_value(Zero((2,), jnp.float32))
        assert jnp.array_equal(dense, jnp.zeros(2))
        ```
    """
    if aval is None:
        aval = checked_aval(value)
    if not fallback:
        return _materialise_as(value, aval, primitive)
    _policy.on_fallback(value, primitive)
    out = _materialise_as(
        value, aval, primitive, refused=lambda error: _refused(value, primitive, operands, error)
    )
    # Noted once done: a refusal that a loop or `cond` recovers from (by holding
    # the plain side in the Value's type) materialised nothing.
    _instrument.note_materialised(value)
    return out


def _materialise_as(value: Value, aval: jc.AbstractValue, primitive, refused=None) -> Any:
    """`materialise_value` once `aval` is known. `refused(error)` makes the error
    to raise when a `materialise()` raises (its own error, unchanged, if `None`)."""
    # Without a `refused`, `materialise()`'s own error is raised as it is.
    out = value.materialise() if refused is None else _call_materialise(value, refused)
    if getattr(out, "aval", None) is aval:
        # The very abstract value promised (a field handed back as it is).
        return out
    out = follow_values(out, lambda v: _call_materialise(v, refused), value)
    out_aval = getattr(out, "aval", None)  # jax.Array and tracers (cheaper than np.shape)
    if isinstance(out_aval, jc.ShapedArray):
        out_shape, out_dtype = out_aval.shape, out_aval.dtype
    else:
        out_shape, out_dtype = np.shape(out), jax.dtypes.result_type(out)
    expected_shape = getattr(aval, "shape", out_shape)
    expected_dtype = getattr(aval, "dtype", out_dtype)
    if tuple(out_shape) != tuple(expected_shape) or (
        out_dtype != expected_dtype and not _is_weak_python_scalar(out)
    ):
        raise QuaxlikeError(
            messages.MATERIALISE_MISMATCH.format(
                type_name=type(value).__qualname__,
                primitive=getattr(primitive, "name", "(none)"),
                expected=f"{expected_dtype}{list(expected_shape)}",
                got=f"{out_dtype}{list(out_shape)}",
            )
        )
    return out


def follow_values(x: Any, step, origin: Any = None) -> Any:
    """`step(x)` while `x` is a Value (a `materialise()` may return another
    Value), at most 100 times; `origin` names the type in the error."""
    depth = 0
    while is_value(x):
        depth += 1
        if depth > 100:
            name = type(x if origin is None else origin).__qualname__
            raise QuaxlikeError(messages.MATERIALISE_LOOP.format(type_name=name))
        x = step(x)
    return x


def array_for_derivatives(value: Any) -> Any:
    """The array `value` stands for, by `Value.dense_for_derivatives()`, followed
    through the Values it returns (a LoRA over a quantised weight); anything
    other than a Value is returned as it is.

    **Arguments:**

    - `value`: a Value, or an array.

    **Returns:**

    An ordinary array, a differentiable function of the Value's leaves.

    !!! example

        ```python
        from quaxlike.quantized import quantize_int8

        q = quantize_int8(jnp.ones((4, 8)))
        dense = quaxlike.internal.array_for_derivatives(q)
        assert dense.shape == (4, 8)
        ```
    """
    return follow_values(value, lambda v: v.dense_for_derivatives())


def _call_materialise(value: Value, refused) -> Any:
    try:
        return value.materialise()
    except MaterialisationError:
        raise  # already says which primitive and type
    except Exception as error:
        if refused is None:
            raise
        raise refused(error) from error


def _is_weak_python_scalar(x) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _refused(value: Value, primitive, operands: Sequence[Any] | None, error: Exception):
    """The error for a type whose `materialise()` raised where `primitive` had no
    rule (`operands` given) or a built-in rule needed it dense: what happened,
    and the way out."""
    type_name = type(value).__name__
    name = getattr(primitive, "name", str(primitive))
    if operands is None:
        return MaterialisationError(
            messages.BUILT_IN_RULE_NEEDED_DENSE.format(
                primitive=name, type_name=type_name, error=f"{type(error).__name__}: {error}"
            )
        )
    annotations = ", ".join(
        f"x{i}: {type(v).__name__}" if isinstance(v, Value) else f"x{i}: ArrayLike"
        for i, v in enumerate(operands)
    )
    position = next((i for i, v in enumerate(operands) if v is value), 0)
    return MaterialisationError(
        messages.NO_RULE_AND_REFUSED.format(
            primitive=name,
            types=", ".join(type(v).__name__ for v in operands),
            type_name=type_name,
            position=position,
            error=f"{type(error).__name__}: {error}",
            annotations=annotations,
            rule_name=f"{name.replace('-', '_')}_p_{type_name.lower()}",
        )
    )
