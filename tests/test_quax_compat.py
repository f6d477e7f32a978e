"""What code written for Quax relies on, beyond the names: the builtin exception
types it catches, `size`/`ndim` read from `aval()`, and the example types
reachable from a bare `import quaxlike`. (Unannotated rule arguments are in
test_dispatch.py, eager mode in test_eager_mode.py, the example types' Quax
names in tests/toolkits/test_quax_names.py.)"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike.lora import LoraArray


def _overriding_type():
    """A fresh type named `Foo` whose `default` runs the primitive on its array;
    two calls make two distinct classes sharing one name."""

    class Foo(quaxlike.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.array

        @staticmethod
        def default(primitive, values, params):
            arrays = [v.array if isinstance(v, quaxlike.Value) else v for v in values]
            return primitive.bind(*arrays, **params)

    return Foo


def test_two_types_overriding_default_is_a_type_error_naming_both():
    foo1, foo2 = _overriding_type(), _overriding_type()
    x = randn(0, (2,))
    with pytest.raises(TypeError) as info:
        quaxlike.quaxify(lambda a, b: a + b)(foo1(x), foo2(x))
    assert isinstance(info.value, quaxlike.QuaxlikeError)
    message = str(info.value)
    # Same module and name: the message tells the two classes apart.
    assert f"{id(foo1):#x}" in message and f"{id(foo2):#x}" in message


def test_a_refusal_to_materialise_is_a_runtime_error():
    weight = LoraArray(randn(1, (3, 3)), rank=2, key=jax.random.key(0))
    with pytest.raises(RuntimeError, match="LoraArray"):
        quaxlike.quaxify(jax.nn.relu)(weight)


def test_an_ambiguity_is_a_lookup_error():
    class Left(quaxlike.DenseArrayValue):
        pass

    class Right(quaxlike.DenseArrayValue):
        pass

    @quaxlike.register(jax.lax.atan2_p)
    def atan2_p_left_any(x: Left, y: jax.Array | quaxlike.Value, **params):
        return x.array

    @quaxlike.register(jax.lax.atan2_p)
    def atan2_p_any_right(x: jax.Array | quaxlike.Value, y: Right, **params):
        return y.array

    x = randn(2, (2,))
    with pytest.raises(LookupError):
        quaxlike.quaxify(jnp.arctan2)(Left(x), Right(x))


class _Vector(quaxlike.ArrayValue):
    """As in a coordinates library: `shape` is the batch shape, and the aval has
    a trailing component axis."""

    components: jax.Array  # (*batch, 3)

    @property
    def shape(self):
        return self.components.shape[:-1]

    def aval(self):
        return jax.typeof(self.components)

    def materialise(self):
        return self.components


def test_size_and_ndim_follow_the_aval_not_shape():
    v = _Vector(jnp.zeros((1, 2, 3), jnp.int32))
    assert v.shape == (1, 2)
    assert v.size == 6 and v.ndim == 3
    dense = np.zeros((1, 2, 3), np.int32)
    assert (v.size, v.ndim) == (dense.size, dense.ndim)


def test_examples_are_attributes_of_a_bare_import():
    # A fresh interpreter: nothing imported the examples yet.
    code = (
        "import quaxlike, sys\n"
        "assert 'quaxlike.lora' not in sys.modules\n"
        "assert quaxlike.symbolic.zero.Zero is quaxlike.zero.Zero\n"
        "assert quaxlike.lora.LoraArray.__name__ == 'LoraArray'\n"
        "try:\n"
        "    quaxlike.not_a_thing\n"
        "except AttributeError as e:\n"
        "    assert 'not_a_thing' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_quax_compatible_names_are_the_homes_themselves():
    # A fresh interpreter, so that the aliases are imported before their homes
    # (the order a Quax user's `import quax.examples.lora` takes).
    code = (
        "import importlib, sys\n"
        "import quaxlike.examples.lora._peft as alias_peft\n"
        "import quaxlike.examples as examples\n"
        "import quaxlike.lora\n"
        "assert alias_peft is sys.modules['quaxlike.lora._peft']\n"
        "assert quaxlike.examples.lora is quaxlike.lora\n"
        "assert quaxlike.lora.__spec__.name == 'quaxlike.lora'\n"
        "for alias, home in examples.HOMES.items():\n"
        "    if alias == 'hijax':\n"
        "        continue  # needs JAX's hijax API\n"
        "    old = importlib.import_module('quaxlike.examples.' + alias)\n"
        "    assert old is importlib.import_module(home), alias\n"
        "    assert getattr(examples, alias) is old\n"
        "    # Every submodule loaded by then answers under the alias too, as\n"
        "    # Quax test shims that copy `sys.modules` entries expect.\n"
        "    for name in [n for n in sys.modules if n.startswith(home + '.')]:\n"
        "        assert sys.modules['quaxlike.examples.' + alias + name[len(home):]] is sys.modules[name]\n"
        "assert quaxlike.unitful is quaxlike.units and quaxlike.zero is quaxlike.symbolic.zero\n"
        "assert quaxlike.structured_matrices is quaxlike.structured.quax_names\n"
        "# The toolkits' code lives in their homes: nothing is executed twice.\n"
        "assert not any(m.__name__.startswith('quaxlike.examples.')\n"
        "               for m in list(sys.modules.values()) if m is not None)\n"
        "import pathlib\n"
        "folder = pathlib.Path(examples.__file__).parent\n"
        "assert sorted(p.name for p in folder.iterdir() if p.suffix == '.py') == ['__init__.py']\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


class _Opaque(quaxlike.ArrayValue):
    """As Quax's test type `MyArray`: a dense wrapper that refuses to materialise
    and runs every primitive on its array, keeping the type."""

    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        raise NotImplementedError("opaque")

    @classmethod
    def default(cls, primitive, values, params):
        arrays = [v.array if isinstance(v, quaxlike.Value) else v for v in values]
        out = primitive.bind(*arrays, **params)
        return [cls(o) for o in out] if primitive.multiple_results else cls(out)


@pytest.mark.parametrize("jit", [False, True])
def test_a_while_predicate_that_refuses_to_materialise_gives_its_one_leaf(jit):
    # jnp.gcd loops while any remainder is non-zero: the predicate is an _Opaque.
    a, b = jnp.array([12, 18, 7]), jnp.array([8, 27, 0])
    fn = quaxlike.quaxify(jnp.gcd)
    out = (jax.jit(fn) if jit else fn)(_Opaque(a), _Opaque(b))
    assert isinstance(out, _Opaque)
    np.testing.assert_array_equal(out.array, jnp.gcd(a, b))


class _Guarded(_Opaque):
    """One array leaf, but a deliberate refusal: the predicate must not be read."""

    def materialise(self):
        raise ValueError("guarded: never dense")


def test_a_while_predicate_that_refuses_on_purpose_is_not_read():
    loop = quaxlike.quaxify(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, x))
    with pytest.raises(quaxlike.MaterialisationError, match="while") as info:
        loop(_Guarded(jnp.array(0)))
    assert isinstance(info.value.__cause__, ValueError)


class _OpaquePair(_Opaque):
    """Two array leaves: neither is known to be the predicate."""

    mask: jax.Array

    @classmethod
    def default(cls, primitive, values, params):
        arrays = [v.array if isinstance(v, quaxlike.Value) else v for v in values]
        out = primitive.bind(*arrays, **params)
        return [cls(o, o) for o in out] if primitive.multiple_results else cls(out, out)


def test_a_while_predicate_of_several_leaves_that_refuses_to_materialise_is_named():
    x = _OpaquePair(jnp.array(0), jnp.array(0))
    loop = quaxlike.quaxify(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, x))
    with pytest.raises(
        quaxlike.MaterialisationError, match="while.*_OpaquePair|_OpaquePair.*while"
    ):
        loop(x)


def test_a_submodule_a_quax_shim_registers_under_an_alias_name_is_importable(monkeypatch):
    # What Quax main's test shim does (the prng example's private `_core`), and the
    # statement its test_prng.py then runs. `quax.examples.prng` is the home
    # `quaxlike.prng`, whose `__name__` is not the alias's: the import finds `_core`
    # only if the home answers names registered under the alias.
    import types

    import quaxlike.examples.prng as prng

    quax = types.ModuleType("quax")
    quax.examples = types.ModuleType("quax.examples")
    quax.examples.prng = prng
    for name, module in [
        ("quax", quax),
        ("quax.examples", quax.examples),
        ("quax.examples.prng", prng),
        ("quax.examples.prng._core", prng),
        ("quaxlike.examples.prng._core", prng),
    ]:
        monkeypatch.setitem(sys.modules, name, module)

    import quax.examples.prng._core as prng_core  # noqa: PLC0415

    assert prng_core is prng is quaxlike.prng
    from quaxlike.examples.prng import _core

    assert _core is prng


def test_a_home_answers_only_the_names_registered_under_its_alias():
    import quaxlike.examples.prng  # noqa: F401

    assert not hasattr(quaxlike.prng, "_core")
    with pytest.raises(AttributeError, match="module 'quaxlike.prng' has no attribute 'nothing'"):
        quaxlike.prng.nothing  # noqa: B018


def test_a_homes_own_getattr_still_answers_and_is_wrapped_once(monkeypatch):
    import types

    from quaxlike.examples import _answer_alias_names

    def own(name):
        if name == "other":
            return "own other"
        raise AttributeError(name)

    home = types.ModuleType("home")
    home.__getattr__ = own  # type: ignore[method-assign]
    registered = types.ModuleType("alias.sub")
    monkeypatch.setitem(sys.modules, "alias.sub", registered)
    _answer_alias_names("alias", home)
    wrapped = home.__getattr__
    _answer_alias_names("alias", home)

    assert home.__getattr__ is wrapped
    assert home.sub is registered
    assert home.other == "own other"
    with pytest.raises(AttributeError, match="module 'home' has no attribute 'missing'"):
        home.missing  # noqa: B018
