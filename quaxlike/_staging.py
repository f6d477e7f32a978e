"""Programs traced once and reused: a function of Values and arrays run as a
`jax.jit` over the array leaves of its arguments. `CompiledCalls` is the one
cache of such calls; the `jit` rule's compiled bodies and `cached_rule`
(quaxlike/internal/_cached_rule.py) each hold one. `shortcuts_apply` is the
one predicate that says when such a call, or any other shortcut, may stand in
for running the rules."""

import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _instrument, _jax_compat as jc, _policy
from ._rules import on_rules_changed, rules_generation, rules_lock


_Rule = TypeVar("_Rule", bound=Callable[..., Any])


# Whether a leaf counts as an array depends on its type alone (`eqx.is_array`
# is an `isinstance` check, about half a microsecond against the `jax.Array`
# ABC): remembered per predicate, per type.
_array_types: dict[Callable, dict[type, bool]] = {}


class SplitTree(NamedTuple):
    """A PyTree taken apart by `split_arrays`: what crosses a JAX
    transformation (`arrays`) and what is closed over (the rest)."""

    arrays: list
    positions: tuple  # the indices of `arrays` among all the leaves
    treedef: Any
    others: tuple  # every leaf, with `None` where an array was

    def join(self, arrays) -> Any:
        """The tree with `arrays` as its array leaves."""
        leaves = list(self.others)
        for i, array in zip(self.positions, arrays):
            leaves[i] = array
        return jtu.tree_unflatten(self.treedef, leaves)

    def structure(self) -> "SplitTree":
        """This split without its arrays (which may be tracers that must not
        be kept), for `join`ing other arrays into the same tree later."""
        return self._replace(arrays=[])

    def key(self) -> tuple:
        """What a program traced on this tree depends on besides its params:
        the structure and non-array leaves, the avals of the array leaves, and
        checked mode. May hold unhashable leaves: hash it before use. Raises
        `TypeError` or `OverflowError` for an array leaf JAX cannot represent
        (a Python int too large), as `jax.typeof` does."""
        avals = tuple(map(jc.aval_key, self.arrays))
        return self.treedef, self.positions, self.others, avals, _instrument.checking.get()


def split_arrays(tree, is_array: Callable[[Any], bool] = eqx.is_array) -> SplitTree:
    """Take `tree` apart into its array leaves and the rest. `is_array` says
    which leaves count as arrays; its answer must depend on the leaf's type."""
    leaves, treedef = jtu.tree_flatten(tree)
    known = _array_types.setdefault(is_array, {})
    arrays, positions = [], []
    for i, leaf in enumerate(leaves):
        answer = known.get(type(leaf))
        if answer is None:
            answer = known[type(leaf)] = is_array(leaf)
        if answer:
            arrays.append(leaf)
            positions.append(i)
            leaves[i] = None
    return SplitTree(arrays, tuple(positions), treedef, tuple(leaves))


class StagedCall:
    """`fn(*args)` as one `jax.jit` (or another `transform` of functions of
    arrays, such as `jax.checkpoint`) over the array leaves of `args`, for one
    structure and set of non-array leaves of the arguments (a `SplitTree`).

    Its owner keys it on the avals of the array leaves too, so it is traced
    once and the structure of its output, recorded then, never changes.
    """

    def __init__(
        self, fn: Callable, name: str, split: SplitTree, transform: Callable = jax.jit, **options
    ):
        self.out_split: SplitTree | None = None
        structure = split.structure()

        def run(*arrays):
            out_split = split_arrays(fn(*structure.join(arrays)))
            self.out_split = out_split.structure()
            return out_split.arrays

        run.__name__ = run.__qualname__ = name
        self.jitted = transform(run, **options)

    def __call__(self, arrays):
        out_arrays = self.jitted(*arrays)
        return self.out_split.join(out_arrays)  # pyright: ignore[reportOptionalMemberAccess]


# Marks the key of a call that belongs to an owner: `(_OWNED, id(owner), key)`.
_OWNED = object()
# Every `CompiledCalls` made (one per `cached_rule`, and the `jit` rule's), for
# reporting their sizes (benchmarks/soak.py); held weakly.
all_compiled_calls: "weakref.WeakSet[CompiledCalls]" = weakref.WeakSet()


class CompiledCalls:
    """A bounded cache of `StagedCall`s by key, as JAX's own `jit` caches are:
    weak in the function and bounded.

    A call may belong to an `owner` (the `jit` rule's sub-program, which holds
    the arrays the user's jitted function closes over): then the cache holds
    the owner weakly, and its calls go when it does. Past `max_size` calls the
    oldest is evicted (code applied to ever new shapes must not grow it
    without bound). A compiled call runs the rules as they were when it was
    traced, so the cache is emptied when a rule is registered, and a call made
    from an older rule set is never stored (`store_if_current`). Every such
    cache is listed in docs/caches.md.
    """

    def __init__(self, max_size: int = 1024):
        self.max_size = max_size
        self._calls: dict[Hashable, StagedCall] = {}
        # id(owner) -> (weak reference to the owner, the keys of its calls)
        self._owners: dict[int, tuple[weakref.ref, set]] = {}
        on_rules_changed(self.clear)
        all_compiled_calls.add(self)

    def __len__(self) -> int:
        return len(self._calls)

    def clear(self) -> None:
        """Forget every call (the owners' weak references go with them)."""
        self._calls.clear()
        self._owners.clear()

    def get(
        self, key: Hashable, make: Callable[[], StagedCall], owner: Any = None
    ) -> StagedCall | None:
        """The call cached under `key` (and `owner`, held weakly), made with
        `make()` the first time, or `None` if `key` cannot be hashed (a
        non-array leaf or a param that cannot: the caller then runs
        uncached)."""
        if owner is not None:
            key = (_OWNED, id(owner), key)
        try:
            call = self._calls.get(key)
        except TypeError:
            return None
        if call is None:
            generation = rules_generation()
            call = make()
            self._store(key, call, owner, generation)
        return call

    def _store(self, key, call, owner, generation: int) -> None:
        with rules_lock:
            if generation != rules_generation():
                return  # a rule was registered meanwhile: `call` may predate it
            if owner is not None and not self._own(key, owner):
                return
            while len(self._calls) >= self.max_size:
                self._evict_oldest()
            self._calls[key] = call

    def _own(self, key, owner) -> bool:
        owner_id = id(owner)
        entry = self._owners.get(owner_id)
        if entry is not None and entry[0]() is not owner:
            self._forget(owner_id)  # another object that had the same id
            entry = None
        if entry is None:
            try:
                ref = weakref.ref(owner, lambda _, owner_id=owner_id: self._forget(owner_id))
            except TypeError:
                return False  # cannot be held weakly: not cached
            entry = self._owners[owner_id] = (ref, set())
        entry[1].add(key)
        return True

    def _forget(self, owner_id: int) -> None:
        entry = self._owners.pop(owner_id, None)
        if entry is not None:
            for key in list(entry[1]):
                self._calls.pop(key, None)

    def _evict_oldest(self) -> None:
        try:
            key = next(iter(self._calls))
        except (StopIteration, RuntimeError):  # emptied, or changed by a weak reference
            return
        self._calls.pop(key, None)
        if type(key) is tuple and key and key[0] is _OWNED:
            entry = self._owners.get(key[1])
            if entry is not None:
                entry[1].discard(key)
                if not entry[1]:
                    self._owners.pop(key[1], None)


def shortcuts_apply(observing: bool | None = None) -> bool:
    """The one predicate every shortcut reads: whether a shortcut (a cached
    compiled call, inlining, materialising at a call) may stand in for running
    the rules one by one. Not while `explain` records every rule (`observing`:
    whether a recorder was on when the asking trace was made; by default,
    whether one is on now), nor under a "warn" or "error" `materialise_policy`
    (read at each call, so a policy entered inside a quaxified function
    applies from there on)."""
    if observing is None:
        observing = _instrument.recorder.get() is not None
    return not observing and _policy.current_mode() == "allow"
