"""The rule registry: one plum dispatcher per primitive, and rule lookup.

Lookup is done here rather than by calling the plum `Function`, for two reasons:
plum caches nothing when a signature uses `ArrayLike` (an "unfaithful" type, see
JAX-INTERNALS §5), and rules may return `NotImplemented` to hand over to the next
applicable rule, which plum has no notion of. So we ask plum's `Signature`s which
methods match and which is more specific, and cache the resulting chain of rules per
(primitive, argument kinds) until the next `register`.
"""

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, TypeVar

import jax
import plum

from . import _instrument, _jax_compat as jc
from ._diagnostics import AmbiguousRuleError, messages, QuaxlikeError
from ._values import Value


_Rule = TypeVar("_Rule", bound=Callable[..., Any])

# One plum Function per primitive holds the registered rules.
_dispatchers: dict[jc.Primitive, plum.Function] = {}
# (primitive, argument kinds) -> _Resolution
_resolution_cache: dict[tuple, "_Resolution"] = {}
# Bumped by every `register`: caches of anything traced with the rules (the
# compiled bodies of the `jit` rule) include it in their keys.
_generation = [0]


def rules_generation() -> int:
    """A number that changes whenever a rule is registered."""
    return _generation[0]


_COMMUTATIVE_NAMES = frozenset(
    ["add", "mul", "max", "min", "and", "or", "xor", "eq", "ne", "add_any"]
)


def _as_primitives(primitive) -> list[jc.Primitive]:
    if isinstance(primitive, (list, tuple)):
        return [p for item in primitive for p in _as_primitives(item)]
    if isinstance(primitive, str):
        found = jc.lax_primitive_by_name(primitive)
        if found is None:
            examples = ", ".join(repr(n) for n in ["add", "mul", "dot_general", "reduce_sum"])
            raise QuaxlikeError(
                messages.UNKNOWN_PRIMITIVE_NAME.format(name=primitive, examples=examples)
            )
        return [found]
    if jc.is_primitive(primitive):
        return [primitive]
    raise QuaxlikeError(
        messages.NOT_A_PRIMITIVE.format(got=primitive, type_name=type(primitive).__qualname__)
    )


def _warn_unannotated(rule: Callable, primitive: jc.Primitive) -> None:
    """In checked mode, point out positional arguments with no annotation.

    They are accepted, as plum (and so Quax) accepts them: such an argument
    matches any type. The warning is guidance only, since a rule meant for one
    type that matches every type is a common slip."""
    if not _instrument.checking.get():
        return
    try:
        signature = inspect.signature(rule)
    except (TypeError, ValueError):  # builtins and the like: let plum judge
        return
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    for parameter in signature.parameters.values():
        if parameter.kind in positional and parameter.annotation is inspect.Parameter.empty:
            warnings.warn(
                messages.UNANNOTATED_RULE_ARGUMENT.format(
                    rule=getattr(rule, "__qualname__", rule),
                    primitive=primitive.name,
                    arg=parameter.name,
                ),
                UserWarning,
                stacklevel=4,
            )


def _dispatcher_for(primitive: jc.Primitive) -> plum.Function:
    try:
        return _dispatchers[primitive]
    except KeyError:
        pass

    def placeholder(*args, **params):  # never called: lookup goes through `dispatch`
        raise AssertionError

    name = f"{primitive.name.replace('-', '_')}_rules"
    placeholder.__name__ = name
    placeholder.__qualname__ = name
    function = plum.Function(placeholder)
    _dispatchers[primitive] = function
    return function


def register(primitive, *, precedence: int = 0) -> Callable[[_Rule], _Rule]:
    """Register a rule saying what a primitive does with some argument types.

    Used as a decorator. The rule's positional arguments are the primitive's
    operands and are dispatched on by type (multiple dispatch with plum): annotate
    each with a `Value` subclass, `jaxtyping.ArrayLike`, or a union of those. Its
    keyword arguments are the primitive's params; accept them with `**params`,
    since JAX adds params between releases.

    A rule returns what the primitive would (an array or Value, or a list of them
    for a primitive with multiple results), or `NotImplemented` to hand over to the
    next matching rule and finally to the `default`. For commutative binary
    primitives (`add`, `mul`, `max`, `min`, `and`, `or`, `xor`, `eq`, `ne`,
    `add_any`) a rule written for `(a, b)` is also used for `(b, a)`.

    **Arguments:**

    - `primitive`: a JAX primitive (`jax.lax.mul_p`), the name of a `jax.lax`
        primitive (`"mul"`), or a list/tuple of those.
    - `precedence`: breaks ties between rules that match equally well; the
        higher wins.

    **Returns:**

    A decorator that registers the rule and returns it unchanged.

    !!! example

        ```python
        class Zero(quaxlike.ArrayValue):
            shape_: tuple[int, ...] = eqx.field(static=True)
            dtype_: np.dtype = eqx.field(static=True)

            def aval(self):
                return jax.core.ShapedArray(self.shape_, self.dtype_)

            def materialise(self):
                return jnp.zeros(self.shape_, self.dtype_)

        @quaxlike.register(jax.lax.mul_p)
        def mul_p_zero_any(x: Zero, y: ArrayLike | quaxlike.ArrayValue, **params):
            return Zero(jnp.broadcast_shapes(x.shape, jnp.shape(y)), x.dtype)

        z = Zero((3,), np.dtype("float32"))
        out = quaxlike.quaxify(lambda a, b: b * a)(z, jnp.ones(3))  # commutative
        assert isinstance(out, Zero)
        ```
    """
    primitives = _as_primitives(primitive)

    def decorator(rule: _Rule) -> _Rule:
        if isinstance(rule, plum.Function):
            implementations = [m.implementation for m in rule.methods]
        elif callable(rule):
            implementations = [rule]
        else:
            raise QuaxlikeError(
                messages.RULE_NOT_CALLABLE.format(primitive=primitives[0].name, got=rule)
            )
        for prim in primitives:
            for implementation in implementations:
                _warn_unannotated(implementation, prim)
                _dispatcher_for(prim).register(implementation, precedence=precedence)
        _resolution_cache.clear()
        _generation[0] += 1
        return cast(_Rule, rule)

    return decorator


def rules_for(primitive: jc.Primitive) -> list[plum.Method]:
    """The rules registered for `primitive`, as plum methods (for inspection).

    **Arguments:**

    - `primitive`: a JAX primitive, such as `jax.lax.mul_p`.

    **Returns:**

    A list of `plum.Method`s, one per registered rule and primitive; each has
    `.signature` (the argument types, and `.signature.precedence`) and
    `.implementation` (the rule function). Empty if nothing is registered.

    !!! example

        ```python
        import quaxlike.examples.zero  # registers Zero's rules

        for method in quaxlike.rules_for(jax.lax.mul_p):
            print(method.implementation.__qualname__, method.signature)
        ```
    """
    function = _dispatchers.get(primitive)
    return [] if function is None else list(function.methods)


# --- lookup ------------------------------------------------------------------


def dispatch_kind(x) -> Any:
    """Everything about `x` that matching a rule's signature depends on: its type,
    and for a tracer also the class of its aval (whether a tracer counts as a
    `jax.Array` depends on it, JAX-INTERNALS §1)."""
    if isinstance(x, jc.Tracer):
        return (type(x), type(x.aval))
    return type(x)


def _method_name(method: plum.Method) -> str:
    implementation = method.implementation
    name = getattr(implementation, "__qualname__", repr(implementation))
    module = getattr(implementation, "__module__", None)
    return f"{module}.{name}" if module else name


def _describe(method: plum.Method) -> str:
    try:
        code = method.implementation.__code__
        location = f"{code.co_filename}:{code.co_firstlineno}"
    except AttributeError:
        location = "<unknown location>"
    return f"  - {_method_name(method)} {method.signature} (precedence {method.signature.precedence}), at {location}"


def _type_names(values: Sequence[Any]) -> str:
    return ", ".join(type(v).__qualname__ for v in values)


def _best(methods: list[plum.Method], values: tuple, primitive: jc.Primitive):
    """The most specific of `methods` (all of which match `values`), following plum's
    resolution: minimal signatures, then the unique highest precedence."""
    candidates: list[plum.Method] = []
    for method in methods:
        signature = method.signature
        if not any(c.signature.is_comparable(signature) for c in candidates):
            candidates.append(method)
            continue
        kept = [c for c in candidates if not signature < c.signature]
        if any(signature <= c.signature for c in candidates):
            candidates = kept + [method]
        else:
            candidates = kept
    if len(candidates) == 1:
        return candidates[0]
    precedences = [c.signature.precedence for c in candidates]
    top = max(precedences)
    if precedences.count(top) == 1:
        return candidates[precedences.index(top)]
    return AmbiguousRuleError(
        messages.AMBIGUOUS.format(
            primitive=primitive.name,
            primitive_expression=_expression_for(primitive),
            types=_type_names(values),
            candidates="\n".join(_describe(c) for c in candidates),
        )
    )


def _expression_for(primitive: jc.Primitive) -> str:
    """Python code naming `primitive`, for messages that suggest a `register`."""
    if getattr(jax.lax, f"{primitive.name}_p", None) is primitive:
        return f"jax.lax.{primitive.name}_p"
    return f"<the `{primitive.name}` primitive>"


def _chain(methods: list[plum.Method], values: tuple, primitive: jc.Primitive) -> list:
    """Matching methods, best first; an ambiguity error ends the chain."""
    remaining = [m for m in methods if m.signature.match(values)]
    chain: list = []
    while remaining:
        best = _best(remaining, values, primitive)
        chain.append(best)
        if isinstance(best, Exception):
            break
        remaining.remove(best)
    return chain


def _default_owner(cls: type) -> type:
    for klass in cls.__mro__:
        if "default" in vars(klass):
            return klass
    return Value


class _Resolution:
    __slots__ = ("chain", "default")

    def __init__(self, chain: list, default: Callable):
        # `chain` holds (method, swapped) pairs, or an exception to raise.
        self.chain = chain
        self.default = default


def _resolve(primitive: jc.Primitive, values: tuple) -> _Resolution:
    function = _dispatchers.get(primitive)
    methods = [] if function is None else list(function.methods)
    chain: list = [
        (m, False) if not isinstance(m, Exception) else m
        for m in _chain(methods, values, primitive)
    ]
    if len(values) == 2 and primitive.name in _COMMUTATIVE_NAMES:
        seen = {id(m) for m, _ in (c for c in chain if not isinstance(c, Exception))}
        swapped = _chain([m for m in methods if id(m) not in seen], values[::-1], primitive)
        if not any(isinstance(c, Exception) for c in chain):
            chain += [(m, True) if not isinstance(m, Exception) else m for m in swapped]

    owners = {}
    for value in values:
        if isinstance(value, Value):
            owner = _default_owner(type(value))
            if owner is not Value:
                owners.setdefault(vars(owner)["default"], owner)
    if len(owners) > 1:
        error = QuaxlikeError(
            messages.CONFLICTING_DEFAULTS.format(
                primitive=primitive.name,
                types=_type_names(values),
                owners=", ".join(o.__qualname__ for o in owners.values()),
            )
        )

        def default(primitive, values, params) -> Any:
            raise error
    elif len(owners) == 1:
        (owner,) = owners.values()
        default = owner.default
    else:
        default = Value.default
    return _Resolution(chain, default)


def _resolution(primitive: jc.Primitive, values: tuple, kinds: tuple | None = None) -> _Resolution:
    key = (primitive, *(map(dispatch_kind, values) if kinds is None else kinds))
    try:
        return _resolution_cache[key]
    except KeyError:
        resolution = _resolution_cache[key] = _resolve(primitive, values)
        return resolution


def chosen_rule(
    primitive: jc.Primitive, values: Sequence[Any], kinds: tuple | None = None
) -> Callable | None:
    """The implementation of the rule `dispatch` would try first for `values`
    (whose `dispatch_kind`s are `kinds`, when known), or `None` (no rule, or an
    ambiguity that `dispatch` will report)."""
    chain = _resolution(primitive, tuple(values), kinds).chain
    if not chain or isinstance(chain[0], Exception):
        return None
    return chain[0][0].implementation


def falls_back_to_materialising(primitive: jc.Primitive, values: Sequence[Any]) -> bool:
    """Whether `dispatch` would go straight to `Value.default` (materialise every
    Value and bind) for `values`: no rule matches and no type overrides
    `default`. Depends only on the kinds of `values` and the registered rules."""
    resolution = _resolution(primitive, tuple(values))
    return not resolution.chain and resolution.default is Value.default


def dispatch(
    primitive: jc.Primitive,
    values: Sequence[Any],
    params: dict[str, Any],
    *,
    name_scopes: bool = False,
):
    """Apply `primitive` to `values` using the registered rules.

    Order: the matching rules, most specific first (a rule returning
    `NotImplemented` hands over to the next); then the single overridden
    `default` among the Values' types; then materialise and bind. With
    `name_scopes`, each rule runs in a `jax.named_scope` carrying its name, so
    the equations it emits say where they came from (used by `explain`).
    """
    values = tuple(values)
    resolution = _resolution(primitive, values)
    for entry in resolution.chain:
        if isinstance(entry, Exception):
            raise entry
        method, swapped = entry
        args = values[::-1] if swapped else values
        if name_scopes:
            with jax.named_scope(_scope_name(method.implementation)):
                out = method.implementation(*args, **params)
        else:
            out = method.implementation(*args, **params)
        if out is not NotImplemented:
            return out, method
    if name_scopes:
        with jax.named_scope(_scope_name(resolution.default)):
            return resolution.default(primitive, values, params), None
    return resolution.default(primitive, values, params), None


def _scope_name(fn) -> str:
    return "quaxlike:" + getattr(fn, "__qualname__", "rule").replace("<locals>.", "")


def default_description(primitive: jc.Primitive, values: Sequence[Any]) -> str:
    """Which `default` handled `primitive` on `values`: `Value.default` (which
    materialises) or a type's own override."""
    default = _resolution(primitive, tuple(values)).default
    if default is Value.default:
        return "default"
    return "default of " + getattr(default, "__qualname__", "a Value type").rsplit(".", 1)[0]
