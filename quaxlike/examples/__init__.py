"""Ready-made Value types. Each lives in its own subpackage (`quaxlike.examples.lora`,
`quaxlike.examples.zero`) with a README describing it."""
