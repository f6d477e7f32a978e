"""One way to say which weights of a model an adapter changes.

`loraify`, `quantize`, `qlora` and `stack_adapters` all take `where=`, and
`select(model, where)` lists the dotted paths it picks, so a selection can be
checked before the model is changed. A `where` is one of:

- a **path pattern**, a string matched against dotted paths (attribute names,
  sequence indices and dict keys joined by `.`): `*` stands for one component, or
  part of one (`*_proj`), and `**` for any number of components. A pattern may name
  a leaf (`"layers.0.weight"`) or a layer (`"layers.0"`, whose weight is taken);
- a **module type**, such as `eqx.nn.Linear` or `flax.nnx.Linear`: the weight of
  every layer of that type;
- `module(*types, **tests)`: module types with **attribute tests**, such as
  `module(eqx.nn.Linear, out_features=10)` (YAX's
  `//module_call[@type="Dense"][@features=10]`); a test is a value to compare with
  or a predicate on the attribute (`in_features=lambda n: n >= 512`);
- a **predicate** `(path: str, leaf) -> bool`, asked of every leaf;
- a **getter** `model -> leaf or leaves`, as for `eqx.tree_at` (`quantize`'s
  original form, still accepted everywhere);
- a list or tuple of any of these (a leaf matching any is selected).

Selections combine: `a | b` (either), `a & b` (both), `~a` (not), and
`a.within(b)` (under a node that `b` matches: YAX's `//b//a`). A layer's weight is
its `weight` attribute (Equinox) or its `kernel` (Flax); `module(..., attr="name")`
takes another. Values (a quantised weight, a LoRA) are single leaves.
"""

import fnmatch
import inspect
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

import quaxlike


__all__ = ["module", "path", "predicate", "select", "Selection"]

KeyPath = tuple[Any, ...]

_WEIGHT_NAMES = ("weight", "kernel")

_BAD_WHERE_MSG = (
    "`{caller}(..., where=...)` takes a path pattern string such as 'layers.*.weight', "
    "a module type such as `eqx.nn.Linear`, `module(eqx.nn.Linear, out_features=10)`, "
    "a predicate `(path: str, leaf) -> bool`, a getter `model -> leaves` (as for "
    "`eqx.tree_at`), or a list of these; got {got!r}. See "
    "`quaxlike.selection`."
)
_NOTHING_MSG = (
    "`{caller}(..., where={where!r})` selected no weight of the model. Check a "
    "selection with `quaxlike.selection.select(model, where)`: patterns match "
    "dotted paths such as 'layers.0.weight' (`*` one component, `**` any number)."
)
_GETTER_MSG = (
    "The getter `where={getter!r}` returned {got!r}, which is not a leaf of the model "
    "(nor a layer with a `weight` or `kernel`). A getter returns leaves of the model it "
    "is given, as for `eqx.tree_at`: `lambda m: [m.layers[0].weight]`. A function of "
    "one argument that tests a leaf should take the path too: "
    "`lambda path, leaf: ...`."
)


def _component(key: Any) -> str:
    if isinstance(key, jtu.GetAttrKey):
        return key.name
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, (jtu.DictKey, jtu.FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def dotted_path(key_path: Sequence[Any]) -> str:
    """The dotted string for a JAX key path.

    **Arguments:**

    - `key_path`: a key path, as `jax.tree_util.tree_flatten_with_path` gives.

    **Returns:**

    The components joined by `.`: `layers.0.weight` for
    `(GetAttrKey('layers'), SequenceKey(0), GetAttrKey('weight'))`.
    """
    return ".".join(_component(k) for k in key_path)


def is_value(x: Any) -> bool:
    """Whether `x` is a quaxlike Value: a selection takes it whole, as one leaf."""
    return isinstance(x, quaxlike.Value)


class _Index:
    """Every node and leaf of a model, with its key path, in tree order."""

    def __init__(self, model: PyTree):
        found, self.treedef = jtu.tree_flatten_with_path(model, is_leaf=is_value)
        self.leaf_paths: list[KeyPath] = [tuple(p) for p, _ in found]
        self.leaves = [leaf for _, leaf in found]
        self.position = {p: i for i, p in enumerate(self.leaf_paths)}
        self.nodes: list[tuple[KeyPath, Any]] = []
        self._walk((), model)
        self.dotted = {p: dotted_path(p) for p, _ in self.nodes}

    def _walk(self, prefix: KeyPath, node: Any) -> None:
        self.nodes.append((prefix, node))
        if prefix in self.position or node is None or is_value(node):
            return
        children = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        for key_path, child in children:
            if key_path:
                self._walk(prefix + tuple(key_path), child)

    def leaves_under(self, prefix: KeyPath) -> list[KeyPath]:
        n = len(prefix)
        return [p for p in self.leaf_paths if p[:n] == prefix]

    def weight_of(self, prefix: KeyPath, node: Any, attr: str | None) -> list[KeyPath]:
        """The leaves a matched node stands for: itself if it is a leaf, else the
        leaves of its weight (`attr`, or `weight` / `kernel`)."""
        if prefix in self.position:
            return [prefix]
        names = (attr,) if attr is not None else _WEIGHT_NAMES
        for name in names:
            if hasattr(node, name):
                leaves = self.leaves_under(prefix + (jtu.GetAttrKey(name),))
                if leaves:
                    return leaves
        return []


class Selection:
    """A selection of leaves of a model; combine with `|`, `&`, `~` and `within`.

    Build one with `path`, `module` or `predicate` (or pass a pattern, a type, a
    predicate or a getter wherever a `where` is taken); `select(model, where)`
    lists what it picks.

    **Arguments:** none: selections are built by `path`, `module` and `predicate`
    and combined with the operators.

    !!! example

        ```python
        mlp = eqx.nn.MLP(4, 2, 8, depth=2, key=jr.key(0))
        biases = path("**.bias")
        picked = select(mlp, path("layers.*.weight") & ~path("layers.0.*") | biases)
        assert picked == [
            "layers.0.bias", "layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias"
        ]
        ```
    """

    def nodes(self, index: _Index) -> set[KeyPath]:
        """The key paths of the nodes this selection matches (before a layer is
        resolved to its weight)."""
        return self.leaves(index)

    def leaves(self, index: _Index) -> set[KeyPath]:
        """The key paths of the leaves this selection picks."""
        raise NotImplementedError

    def __or__(self, other: Any) -> "Selection":
        return _Combined("|", [self, as_selection(other)])

    def __ror__(self, other: Any) -> "Selection":
        return _Combined("|", [as_selection(other), self])

    def __and__(self, other: Any) -> "Selection":
        return _Combined("&", [self, as_selection(other)])

    def __rand__(self, other: Any) -> "Selection":
        return _Combined("&", [as_selection(other), self])

    def __invert__(self) -> "Selection":
        return _Not(self)

    def within(self, outer: Any) -> "Selection":
        """The leaves of this selection that lie under a node `outer` matches.

        **Arguments:**

        - `outer`: any `where`: a pattern (`"encoder"`), a module type, ...

        **Returns:**

        A `Selection`.
        """
        return _Within(self, as_selection(outer))


class _Pattern(Selection):
    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self._split = [p.split(".") for p in self.patterns]

    def __repr__(self) -> str:
        inner = ", ".join(map(repr, self.patterns))
        return f"path({inner})"

    def nodes(self, index: _Index) -> set[KeyPath]:
        return {
            p
            for p, _ in index.nodes
            if p and any(_glob(s, index.dotted[p].split(".")) for s in self._split)
        }

    def leaves(self, index: _Index) -> set[KeyPath]:
        nodes = dict(index.nodes)
        return {leaf for p in self.nodes(index) for leaf in index.weight_of(p, nodes[p], None)}


def _glob(pattern: list[str], path: list[str]) -> bool:
    """Match path components against pattern components, where `*`-style wildcards
    apply within one component and `**` matches any number of components."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _glob(rest, path[1:])


_MISSING = object()


class _Module(Selection):
    def __init__(self, kinds: tuple[Any, ...], tests: dict[str, Any], attr: str | None):
        self.kinds = kinds
        self.tests = tests
        self.attr = attr

    def __repr__(self) -> str:
        items = [getattr(k, "__qualname__", repr(k)) for k in self.kinds]
        items += [f"{name}={value!r}" for name, value in self.tests.items()]
        if self.attr is not None:
            items.append(f"attr={self.attr!r}")
        return f"module({', '.join(items)})"

    def _matches(self, node: Any) -> bool:
        types = tuple(k for k in self.kinds if isinstance(k, type))
        checks = [k for k in self.kinds if not isinstance(k, type)]
        if types and not isinstance(node, types):
            return False
        for check in checks:
            if not _truth(check, node):
                return False
        for name, expected in self.tests.items():
            got = getattr(node, name, _MISSING)
            if got is _MISSING:
                return False
            if not (_truth(expected, got) if callable(expected) else _equal(got, expected)):
                return False
        return True

    def nodes(self, index: _Index) -> set[KeyPath]:
        # Layers, not leaves: a predicate alone is asked of modules, not of arrays.
        return {
            p
            for p, node in index.nodes
            if p not in index.position and node is not None and self._matches(node)
        }

    def leaves(self, index: _Index) -> set[KeyPath]:
        nodes = dict(index.nodes)
        return {leaf for p in self.nodes(index) for leaf in index.weight_of(p, nodes[p], self.attr)}


def _truth(check: Callable[[Any], Any], x: Any) -> bool:
    try:
        return bool(check(x))
    except (AttributeError, TypeError, ValueError):
        return False


def _equal(got: Any, expected: Any) -> bool:
    try:
        return bool(got == expected)
    except (TypeError, ValueError):  # an array compared with a scalar, say
        return False


class _Predicate(Selection):
    def __init__(self, function: Callable[[str, Any], Any]):
        self.function = function

    def __repr__(self) -> str:
        return f"predicate({getattr(self.function, '__qualname__', self.function)!r})"

    def leaves(self, index: _Index) -> set[KeyPath]:
        return {
            p
            for p, leaf in zip(index.leaf_paths, index.leaves)
            if self.function(dotted_path(p), leaf)
        }


class _Marker:
    """Stands in for leaf `i` while a getter runs on the model."""

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"<leaf {self.i}>"


class _Getter(Selection):
    def __init__(self, getter: Callable[[Any], Any]):
        self.getter = getter

    def __repr__(self) -> str:
        return f"getter({getattr(self.getter, '__qualname__', self.getter)!r})"

    def leaves(self, index: _Index) -> set[KeyPath]:
        marked = jtu.tree_unflatten(index.treedef, [_Marker(i) for i in range(len(index.leaves))])
        got = self.getter(marked)
        items = got if isinstance(got, (list, tuple)) else [got]
        found: set[KeyPath] = set()
        for item in items:
            markers = _markers_of(item)
            if not markers:
                raise TypeError(_GETTER_MSG.format(getter=self.getter, got=item))
            found.update(index.leaf_paths[m.i] for m in markers)
        return found


def _markers_of(item: Any) -> list[_Marker]:
    if isinstance(item, _Marker):
        return [item]
    for name in _WEIGHT_NAMES:  # a layer: its weight
        if hasattr(item, name) and not isinstance(getattr(item, name), _Marker | None):
            return _markers_of(getattr(item, name))
        if isinstance(getattr(item, name, None), _Marker):
            return [getattr(item, name)]
    is_marker = lambda x: isinstance(x, _Marker)  # noqa: E731
    leaves = jtu.tree_leaves(item, is_leaf=is_marker)
    # A container of exactly one leaf (an `nnx.Param`, say) stands for it.
    return leaves if len(leaves) == 1 and is_marker(leaves[0]) else []


class _Combined(Selection):
    def __init__(self, op: str, parts: Iterable[Selection]):
        self.op = op
        self.parts = []
        for part in parts:  # flatten a | (b | c)
            self.parts.extend(
                part.parts if isinstance(part, _Combined) and part.op == op else [part]
            )

    def __repr__(self) -> str:
        return "(" + f" {self.op} ".join(map(repr, self.parts)) + ")"

    def _fold(self, sets: list[set[KeyPath]]) -> set[KeyPath]:
        out = set(sets[0])
        for s in sets[1:]:
            out = out | s if self.op == "|" else out & s
        return out

    def nodes(self, index: _Index) -> set[KeyPath]:
        return self._fold([part.nodes(index) for part in self.parts])

    def leaves(self, index: _Index) -> set[KeyPath]:
        return self._fold([part.leaves(index) for part in self.parts])


class _Not(Selection):
    def __init__(self, inner: Selection):
        self.inner = inner

    def __repr__(self) -> str:
        return f"~{self.inner!r}"

    def leaves(self, index: _Index) -> set[KeyPath]:
        return set(index.leaf_paths) - self.inner.leaves(index)


class _Within(Selection):
    def __init__(self, inner: Selection, outer: Selection):
        self.inner = inner
        self.outer = outer

    def __repr__(self) -> str:
        return f"{self.inner!r}.within({self.outer!r})"

    def leaves(self, index: _Index) -> set[KeyPath]:
        outer = self.outer.nodes(index)
        return {
            p for p in self.inner.leaves(index) if any(p[:n] in outer for n in range(len(p) + 1))
        }


def path(*patterns: str) -> Selection:
    """Select by dotted path patterns.

    **Arguments:**

    - `*patterns`: strings matched against dotted paths; `*` stands for one
        component (or part of one), `**` for any number of them. A pattern that
        names a layer takes its weight.

    **Returns:**

    A `Selection` of the leaves any pattern picks.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, depth=2, key=jr.key(0))
        assert select(mlp, path("layers.0")) == ["layers.0.weight"]
        assert select(mlp, path("**.bias")) == [f"layers.{i}.bias" for i in range(3)]
        ```
    """
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"`path(...)` takes pattern strings; got {patterns!r}.")
    return _Pattern(patterns)


def module(*kinds: Any, attr: str | None = None, **tests: Any) -> Selection:
    """Select the weights of layers by type and attributes.

    **Arguments:**

    - `*kinds`: module types (a layer of any of them matches), such as
        `eqx.nn.Linear` or `flax.nnx.Linear`, and predicates `layer -> bool`
        (a layer must pass each).
    - `attr`: the attribute holding the layer's weight (by default `weight`, else
        `kernel`).
    - `**tests`: attribute tests: `out_features=10` compares, a callable
        (`in_features=lambda n: n >= 512`) is asked.

    **Returns:**

    A `Selection` of the weight of every matching layer.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 10, 8, depth=2, key=jr.key(0))
        assert select(mlp, module(eqx.nn.Linear, out_features=10)) == ["layers.2.weight"]
        wide = module(eqx.nn.Linear, in_features=lambda n: n > 3, attr="bias")
        assert select(mlp, wide) == ["layers.1.bias", "layers.2.bias"]
        ```
    """
    return _Module(kinds, tests, attr)


def predicate(function: Callable[[str, Any], Any]) -> Selection:
    """Select the leaves for which `function(path, leaf)` is true.

    **Arguments:**

    - `function`: takes a leaf's dotted path and the leaf.

    **Returns:**

    A `Selection`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, depth=1, key=jr.key(0))
        square = predicate(lambda path, leaf: getattr(leaf, "shape", ()) == (8, 8))
        assert select(mlp, square) == []
        ```
    """
    return _Predicate(function)


def _positional_arity(function: Callable[..., Any]) -> int | None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is p.empty for p in parameters)


def as_selection(where: Any, caller: str = "select") -> Selection:
    """`where` in any of its forms (see this module's docstring) as a `Selection`.

    **Arguments:**

    - `where`: a pattern, module type, predicate, getter, `Selection`, or a list
        or tuple of them.
    - `caller`: the function's name, for the error message.

    **Returns:**

    A `Selection`.
    """
    if isinstance(where, Selection):
        return where
    if isinstance(where, str):
        return _Pattern([where])
    if isinstance(where, type):
        return _Module((where,), {}, None)
    if isinstance(where, types.UnionType):  # eqx.nn.Linear | eqx.nn.Conv
        return _Module(where.__args__, {}, None)
    if isinstance(where, (list, tuple)) and where:
        if all(isinstance(w, str) for w in where):
            return _Pattern(where)
        return _Combined("|", [as_selection(w, caller) for w in where])
    if callable(where):
        return _Getter(where) if _positional_arity(where) == 1 else _Predicate(where)
    raise TypeError(_BAD_WHERE_MSG.format(caller=caller, got=where))


def selected(model: PyTree, where: Any, caller: str = "select") -> list[int]:
    """The positions, among `jax.tree_util.tree_flatten_with_path(model,
    is_leaf=is_value)`'s leaves, of the leaves `where` picks, in tree order.

    **Arguments:**

    - `model`: any PyTree.
    - `where`: any selection (see this module's docstring).
    - `caller`: the function's name, for error messages.

    **Returns:**

    A sorted list of leaf positions.
    """
    index = _Index(model)
    found = as_selection(where, caller).leaves(index)
    return sorted(index.position[p] for p in found)


def replace_selected(
    model: PyTree, where: Any, make: Callable[[Any], Any], caller: str = "select"
) -> PyTree:
    """`model` with every leaf `where` picks replaced by `make(leaf)`.

    **Arguments:**

    - `model`: any PyTree.
    - `where`: any selection (see this module's docstring).
    - `make`: builds the replacement of one leaf (a quantised weight, say).
    - `caller`: the function's name, for error messages.

    **Returns:**

    The model with the selected leaves replaced.

    **Raises:**

    `ValueError` if `where` picks nothing.
    """
    leaves, treedef = jtu.tree_flatten(model, is_leaf=is_value)
    positions = selected(model, where, caller)
    if not positions:
        raise ValueError(_NOTHING_MSG.format(caller=caller, where=where))
    for i in positions:
        leaves[i] = make(leaves[i])
    return jtu.tree_unflatten(treedef, leaves)


def select(model: PyTree, where: Any) -> list[str]:
    """The dotted paths of the leaves of `model` that `where` picks: what
    `loraify`, `quantize`, `qlora` or `stack_adapters` would change.

    **Arguments:**

    - `model`: any PyTree: an Equinox or Flax NNX model, a dict of parameters.
    - `where`: a path pattern, a module type, `module(...)` with attribute tests,
        a predicate `(path, leaf) -> bool`, a getter, a combination of these
        (`|`, `&`, `~`, `.within`), or a list of them.

    **Returns:**

    The dotted paths, in tree order.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, depth=2, key=jr.key(0))
        assert select(mlp, eqx.nn.Linear) == [f"layers.{i}.weight" for i in range(3)]
        assert select(mlp, "layers.*.weight") == select(mlp, eqx.nn.Linear)
        last = module(eqx.nn.Linear, out_features=2)
        assert select(mlp, last) == ["layers.2.weight"]
        assert select(mlp, eqx.nn.Linear & ~last) == ["layers.0.weight", "layers.1.weight"]
        ```
    """
    index = _Index(model)
    found = as_selection(where).leaves(index)
    return [dotted_path(index.leaf_paths[i]) for i in sorted(index.position[p] for p in found)]
