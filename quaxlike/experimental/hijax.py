"""Values whose metadata lives in a JAX type: quaxlike on top of `jax.experimental.hijax`.

`quaxify` runs unchanged code on a Value; JAX's high-level types (hijax) give a
type its own primitives and let it decide its tangent and cotangent types, its
`vmap` and `scan` behaviour, and how it prints in a jaxpr. `HiValue` combines
the two: an `ArrayValue` whose single leaf is a hijax value, so `quaxify`
dispatches `jax.numpy` code on the outside while the type, and what JAX's
transformations do with it, live in the leaf. `register_rules` maps the `lax`
primitives that `jax.numpy` emits onto the type's own hijax functions.

The design note `docs/hijax.md` says when to use this rather than a plain
`ArrayValue`. Importing this module on a JAX without the needed hijax API raises
`HijaxUnavailableError` (an `ImportError`), naming the installed JAX and the
releases that have it.

!!! warning

    Experimental twice over: `jax.experimental.hijax` itself changes between
    releases. The names JAX renames are re-exported from here
    (`HiPrim`, `HiType`, `MappingSpec`, `ShapedArray`, `instantiate_zeros`,
    `register_hitype`), so code written against this module does not change.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.core
from jaxtyping import ArrayLike

from .. import _hijax_compat as hc
from .._logical_sharding import with_leaf_specs
from .._rules import register
from .._values import ArrayValue


hc.require_hijax()

HiPrim: Any = hc.HiPrim
HiType: Any = hc.HiType
MappingSpec: Any = hc.MappingSpec
ShapedArray = jax.core.ShapedArray
instantiate_zeros: Any = hc.instantiate_zeros
register_hitype: Any = hc.register_hitype
HijaxUnavailableError = hc.HijaxUnavailableError

__all__ = (
    "HiPrim",
    "HiType",
    "HiValue",
    "HijaxUnavailableError",
    "MappingSpec",
    "ShapedArray",
    "instantiate_zeros",
    "register_hitype",
    "register_rules",
)


class HiValue(ArrayValue):
    """An `ArrayValue` whose one leaf, `leaf`, is a hijax value.

    Subclass it (usually with an `__init__` that builds the leaf, and properties
    that read the leaf's type), then give it rules with `register_rules`. Two
    things are fixed here because they are easy to get wrong:

    - `aval()` is a plain `ShapedArray` with the shape and dtype of the leaf's
      type, never the hijax type itself: `jax.numpy` only accepts tracers whose
      aval is an array type, so a hijax aval would make it refuse the Value.
    - `materialise()` refuses: an ordinary array would silently drop what the
      type carries, so a primitive without a rule is an error.

    **Arguments:**

    - `leaf`: the hijax value (or, under a transformation, a tracer of its type).

    !!! example

        ```python
        from quaxlike.experimental.hijax_units import UnitfulArray, wrap
        from quaxlike.units import meters


        class Length(HiValue):
            def __init__(self, array):
                # a tracer of the leaf's type is a UnitfulArray too: keep it
                self.leaf = array if isinstance(array, UnitfulArray) else wrap(array, meters)


        x = Length(jnp.array([1.0, 2.0]))
        assert x.shape == (2,) and type(x.aval()) is jax.core.ShapedArray
        ```
    """

    leaf: Any

    def __init__(self, leaf: Any, /):
        self.leaf = leaf

    def aval(self) -> jax.core.ShapedArray:
        ty = jax.typeof(self.leaf)
        return jax.core.ShapedArray(ty.shape, ty.dtype)

    def logical_leaf_specs(self, spec: Any) -> "HiValue":
        """The leaf has the value's shape and follows its sharding (see
        `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with `spec` in place of its leaf.
        """
        return with_leaf_specs(self, leaf=spec)

    def materialise(self):
        raise ValueError(
            f"Refusing to materialise {type(self).__name__}: an ordinary array would "
            f"drop what its hijax type ({jax.typeof(self.leaf)}) carries. Register a "
            "rule for the primitive that needed one (register_rules, or "
            "quaxlike.register), or override `materialise`."
        )


def _positional_count(fn: Callable[..., Any]) -> int:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(fn).parameters.values())


def _wanted_params(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The primitive parameters `fn` declares (keyword-only), or `None` for all of
    them when it takes `**kwargs`."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def register_rules(cls: type[HiValue], rules: Mapping[Any, Callable[..., Any]], /) -> None:
    """Give a `HiValue` subclass rules that apply hijax functions.

    For each `{primitive: function}` entry, one rule is registered per way of
    placing `cls` among the function's positional operands (at least one `cls`,
    plain arrays elsewhere), so `x * y`, `x * 2.0` and `2.0 * x` all dispatch. A
    rule passes the leaves of the `cls` operands to `function`, with the
    primitive's parameters that `function` declares as keyword-only (all of them
    if it takes `**kwargs`), and wraps a hijax result in `cls` (a plain result,
    such as a comparison's, is returned as it is).

    **Arguments:**

    - `cls`: the `HiValue` subclass.
    - `rules`: a mapping from JAX primitives to functions of hijax values.

    **Returns:**

    Nothing: the rules are registered with `quaxlike.register`.

    **Raises:**

    `NotImplementedError` for a primitive with several results (write its rule
    with `quaxlike.register`).

    !!! example

        ```python
        from jax import lax
        from quaxlike.experimental.hijax_units import int_pow, mul, UnitfulArray, wrap
        from quaxlike.units import meters


        class Length(HiValue):
            def __init__(self, array):
                self.leaf = array if isinstance(array, UnitfulArray) else wrap(array, meters)


        register_rules(
            Length,
            {
                lax.mul_p: mul,  # mul(x, y): no parameters wanted
                lax.integer_pow_p: lambda q, *, y: int_pow(q, y),  # wants `y`
            },
        )
        area = quaxlike.quaxify(lambda a: 2.0 * a**2)(Length(jnp.array([3.0])))
        assert jax.typeof(area.leaf).units == ((meters, 2),)
        ```
    """
    for primitive, fn in rules.items():
        if primitive.multiple_results:
            raise NotImplementedError(
                f"register_rules: `{primitive.name}` has multiple results, which one "
                f"{cls.__name__} cannot hold. Write its rule with quaxlike.register, "
                "returning a list."
            )
        count = _positional_count(fn)
        for placement in range(1, 2**count):
            kinds = [cls if placement >> i & 1 else ArrayLike for i in range(count)]
            _register_placement(cls, primitive, fn, kinds)


def _register_placement(cls, primitive, fn, kinds) -> None:
    wanted = _wanted_params(fn)

    def rule(*operands, **params):
        leaves = [x.leaf if isinstance(x, cls) else x for x in operands]
        if wanted is not None:
            params = {k: v for k, v in params.items() if k in wanted}
        out = fn(*leaves, **params)
        return cls(out) if hc.hi_type(out) is not None else out

    names = "_".join("arraylike" if k is ArrayLike else k.__name__.lower() for k in kinds)
    rule.__name__ = rule.__qualname__ = f"{primitive.name}_{names}"
    rule.__doc__ = f"`{primitive.name}` on ({names}); made by register_rules."
    parameters = [
        inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_ONLY, annotation=k)
        for i, k in enumerate(kinds)
    ]
    parameters.append(inspect.Parameter("params", inspect.Parameter.VAR_KEYWORD))
    rule.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    rule.__annotations__ = {f"x{i}": k for i, k in enumerate(kinds)}
    register(primitive)(rule)
