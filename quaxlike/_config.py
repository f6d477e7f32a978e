"""The `QUAXLIKE_*` environment variables, read and validated once at import.

- `QUAXLIKE_MATERIALISE`: the starting `materialise_policy` mode, one of
  `allow` (the default), `warn` or `error`.
- `QUAXLIKE_CHECK`: `1` turns on checked mode for every `quaxify` (each rule's
  outputs are compared with the primitive's own abstract evaluation); `0` (the
  default) leaves it to `quaxify(..., check=True)`.
"""

import os


MATERIALISE_MODES = ("allow", "warn", "error")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _read_materialise_mode() -> str:
    raw = os.environ.get("QUAXLIKE_MATERIALISE", "allow")
    mode = raw.strip().lower()
    if mode not in MATERIALISE_MODES:
        raise ValueError(
            f"The environment variable QUAXLIKE_MATERIALISE={raw!r} is not a "
            f"materialisation mode; use one of {', '.join(MATERIALISE_MODES)} (or unset "
            "it for the default, 'allow')."
        )
    return mode


def _read_check() -> bool:
    raw = os.environ.get("QUAXLIKE_CHECK", "0")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"The environment variable QUAXLIKE_CHECK={raw!r} is not a switch; use 1 to "
        "check every rule's outputs, or 0 (the default) to check only where "
        "`quaxify(..., check=True)` asks."
    )


MATERIALISE_MODE_AT_IMPORT = _read_materialise_mode()
CHECK_AT_IMPORT = _read_check()
