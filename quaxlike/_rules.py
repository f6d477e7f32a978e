"""The rule registry: one plum dispatcher per primitive, and rule lookup.

Lookup asks plum's `Signature`s which rules match and which is more specific,
rather than calling the plum `Function`: plum caches nothing when a signature
uses `ArrayLike` (an "unfaithful" type: quaxlike/internal/README.md, "JAX
facts"), and has no notion of a rule returning `NotImplemented` to hand over.
The answer is cached as a `Plan` per (primitive, argument kinds) until the next
`register`: everything the trace and its shortcuts need to know, so nothing
outside this module predicts what dispatch will do. Caches elsewhere that
depend on the rules subscribe with `on_rules_changed`, and store what they
computed with `store_if_current`, so that nothing computed from an older rule
set is stored once a newer one is visible (docs/caches.md lists every cache).
"""

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast, TypeVar

import jax
import plum

from . import _instrument, _jax_compat as jc, _plum_types  # noqa: F401 (conversions)
from ._diagnostics import (
    ambiguous_rule_error,
    ConflictingDefaultsError,
    messages,
    QuaxlikeError,
    rule_name,
    type_labels,
    value_type_names,
)
from ._values import Value


_Rule = TypeVar("_Rule", bound=Callable[..., Any])

# One plum Function per primitive holds the registered rules.
_dispatchers: dict[jc.Primitive, plum.Function] = {}
# (primitive, *argument kinds) -> Plan
_plans: dict[tuple, "Plan"] = {}
# Called with no arguments after every `register`.
_subscribers: list[Callable[[], None]] = []
# Asked once for each primitive that has no rules yet; may register some.
_rule_providers: list[Callable[[jc.Primitive], None]] = []
_asked_providers: "weakref.WeakSet[jc.Primitive]" = weakref.WeakSet()
# Counts the changes to the rules. `register` changes the rules, bumps it and
# empties every cache while holding `rules_lock`; `store_if_current` stores
# under the same lock only if it has not moved since the value was computed.
_generation = 0
rules_lock = threading.RLock()


def rules_generation() -> int:
    """The number of changes to the rules so far: read it before computing
    something from the rules, and hand it to `store_if_current`."""
    return _generation


def store_if_current(cache: dict, key: Any, value: Any, generation: int) -> None:
    """`cache[key] = value`, unless a rule was registered since `generation`
    (then `value` may have been computed from the older rules, and the cache
    has been emptied since: it must not hold `value`)."""
    with rules_lock:
        if generation == _generation:
            cache[key] = value


def on_rules_changed(callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback()` whenever a rule is registered, for caches of anything
    that depends on the rules (plans, verdicts, compiled programs). Returns
    `callback`, so it can be used as a decorator."""
    _subscribers.append(callback)
    return callback


def add_rule_provider(provider: Callable[[jc.Primitive], None]) -> Callable[[jc.Primitive], None]:
    """Ask `provider(primitive)` once for each primitive that has no rules when
    its first plan is made; it may `register` rules for it. For families of
    primitives created after quaxlike is imported (Equinox's filter primitives:
    lineax makes one when it is imported). Returns `provider`."""
    _rule_providers.append(provider)
    return provider


def _provided_dispatcher(primitive: jc.Primitive) -> plum.Function | None:
    if primitive not in _asked_providers:
        _asked_providers.add(primitive)
        for provider in _rule_providers:
            provider(primitive)
    return _dispatchers.get(primitive)


def _rules_changed() -> None:
    # Under `rules_lock`, held by `register` across the change itself.
    global _generation
    _generation += 1
    _plans.clear()
    for callback in _subscribers:
        callback()


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


def _dispatcher_for(primitive: jc.Primitive) -> plum.Function:
    function = _dispatchers.get(primitive)
    if function is None:

        def placeholder(*args, **params):  # never called: lookup goes through `plan_for`
            raise AssertionError

        placeholder.__name__ = placeholder.__qualname__ = (
            f"{primitive.name.replace('-', '_')}_rules"
        )
        function = _dispatchers[primitive] = plum.Function(placeholder)
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
        with rules_lock:
            for prim in primitives:
                for implementation in implementations:
                    _instrument.warn_unannotated(implementation, prim)
                    _dispatcher_for(prim).register(implementation, precedence=precedence)
            _rules_changed()
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
        import quaxlike.symbolic.zero  # registers Zero's rules

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
    `jax.Array` depends on it: quaxlike/internal/README.md, "JAX facts")."""
    if isinstance(x, jc.Tracer):
        return (type(x), type(x.aval))
    return type(x)


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
    return ambiguous_rule_error(primitive, values, candidates)


def _chain(methods: list[plum.Method], values: tuple, primitive: jc.Primitive, swapped: bool):
    """`(method, swapped)` for each of `methods` that matches `values`, best
    first; an ambiguity error ends the chain."""
    remaining = [m for m in methods if m.signature.match(values)]
    chain: list = []
    while remaining:
        best = _best(remaining, values, primitive)
        if isinstance(best, Exception):
            return chain + [best]
        chain.append((best, swapped))
        remaining.remove(best)
    return chain


def _default_owner(cls: type) -> type:
    return next((klass for klass in cls.__mro__ if "default" in vars(klass)), Value)


def sub_program_rule(
    jaxpr_of: Callable[[dict], tuple], shortcut: Callable[..., Any] | None = None
) -> Callable[[_Rule], _Rule]:
    """Mark a rule as one that runs a sub-program held in its primitive's params
    (`jit`, `closed_call`). `jaxpr_of(params)` gives `(closed_jaxpr, inlines)`
    (whether the rule runs it in place, as JAX inlines `jax.numpy`'s `jit`s), or
    `(None, False)` when the rule does something else for these params. The
    optional `shortcut(trace, primitive, plan, tracers, values, kinds, params)`
    is the rule's own faster way to its result, or `NotImplemented`."""

    def mark(rule: _Rule) -> _Rule:
        rule.__quaxlike_sub_program__ = (jaxpr_of, shortcut)  # pyright: ignore[reportFunctionMemberAccess]
        return rule

    return mark


class Plan:
    """What dispatch does for one primitive and one combination of argument kinds.

    - `chain`: `(method, swapped)` pairs, most specific first (`swapped` for a
        commutative primitive's rule matched with its two arguments swapped);
        an exception in it is raised when reached (an ambiguity).
    - `default`: what runs when every rule in the chain hands over: a type's own
        `default`, `Value.default` (materialise and bind), or a function raising
        `ConflictingDefaultsError`; `default_name` says which, for `explain`.
    - `rule`: the implementation of the rule tried first, or `None`.
    - `sub_program`, `shortcut`: that rule's `jaxpr_of` and `shortcut` (see
        `sub_program_rule`), or `None`.
    - `only_materialises`: no rule matches and the default is `Value.default`.
    """

    __slots__ = (
        "chain",
        "rule",
        "default",
        "default_name",
        "sub_program",
        "shortcut",
        "only_materialises",
    )

    def __init__(self, chain: list, default: Callable, default_name: str):
        self.chain = tuple(chain)
        self.default, self.default_name = default, default_name
        first = chain[0] if chain else None
        self.rule = first[0].implementation if isinstance(first, tuple) else None
        marked = getattr(self.rule, "__quaxlike_sub_program__", None)
        self.sub_program, self.shortcut = marked or (None, None)
        self.only_materialises = not chain and default is Value.default

    def apply(
        self, primitive: jc.Primitive, values: tuple, params: dict, *, name_scopes: bool = False
    ):
        """Run the chain on `values`, then the default: `(output, method)`, with
        `method` `None` when the default produced the output. With
        `name_scopes`, each rule runs in a `jax.named_scope` carrying its name,
        so the equations it emits say where they came from (for `explain`)."""
        for entry in self.chain:
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
            with jax.named_scope(_scope_name(self.default)):
                return self.default(primitive, values, params), None
        return self.default(primitive, values, params), None


def _make_plan(primitive: jc.Primitive, values: tuple) -> Plan:
    function = _dispatchers.get(primitive) or _provided_dispatcher(primitive)
    methods = [] if function is None else list(function.methods)
    chain = _chain(methods, values, primitive, swapped=False)
    if len(values) == 2 and primitive.name in _COMMUTATIVE_NAMES:
        if not any(isinstance(c, Exception) for c in chain):
            seen = {id(m) for m, _ in chain}
            unseen = [m for m in methods if id(m) not in seen]
            chain += _chain(unseen, values[::-1], primitive, swapped=True)

    owners = {}
    for value in values:
        if isinstance(value, Value):
            owner = _default_owner(type(value))
            if owner is not Value:
                owners.setdefault(vars(owner)["default"], owner)
    if not owners:
        return Plan(chain, Value.default, "default")
    if len(owners) == 1:
        (owner,) = owners.values()
        qualname = getattr(owner.default, "__qualname__", "a Value type")
        return Plan(chain, owner.default, "default of " + qualname.rsplit(".", 1)[0])
    error = ConflictingDefaultsError(
        messages.CONFLICTING_DEFAULTS.format(
            primitive=primitive.name,
            types=value_type_names(values),
            owners=", ".join(type_labels(owners.values())),
        )
    )

    def conflicting_defaults(primitive, values, params) -> Any:
        raise error

    return Plan(chain, conflicting_defaults, "conflicting defaults")


def plan_for(primitive: jc.Primitive, values: Sequence[Any], kinds: tuple | None = None) -> Plan:
    """The `Plan` for `primitive` applied to `values` (whose `dispatch_kind`s
    are `kinds`, when already known). Cached until the next `register`."""
    key = (primitive, *(map(dispatch_kind, values) if kinds is None else kinds))
    try:
        return _plans[key]
    except KeyError:
        generation = _generation
        plan = _make_plan(primitive, tuple(values))
        store_if_current(_plans, key, plan, generation)
        return plan


def _scope_name(fn) -> str:
    return "quaxlike:" + rule_name(fn, qualified=False).replace("<locals>.", "")
