"""Ready-made Value types. Each lives in its own subpackage with a README
describing it: `lora`, `zero`, `constant`, `quantized`, `sparse`, `structured`,
`named`, `unitful` and `prng` (for example `quaxlike.examples.lora`)."""
