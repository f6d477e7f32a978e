"""Rules for higher-order primitives (jit, cond, while, scan, checkpoint, shard_map) and the
custom-derivative hooks.

These rules are ordinary registrations, annotated with the broadest types
(`ArrayLike | Value`), so a user's rule for their own type on, say, `scan_p` is
more specific and wins by normal dispatch. Imported for its side effects.
"""

from . import (  # noqa: F401
    _cond,
    _custom_ad,
    _eager_operators,
    _equinox,
    _jit,
    _loops,
    _remat,
    _sharding,
)
