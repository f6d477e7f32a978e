"""What `calibration.py`, `qat.py` and `w8a8.py` measure on the demo's character
transformer (`quaxlike.demo`): the next character's log-probabilities over
windows of text, their mean cross-entropy, and the KL divergence of one model's
distribution from another's."""

import equinox as eqx
import jax
import jax.numpy as jnp

from quaxlike.demo import logits_fn


#: Characters per window.
LENGTH = 32


def log_probabilities(model, windows):
    """Log-probabilities of each next character, `(windows, LENGTH - 1, vocab)`."""
    return jax.nn.log_softmax(eqx.filter_jit(logits_fn)(model, windows[:, :-1]))


def mean_loss(log_p, windows) -> float:
    """The mean cross-entropy of the next character."""
    labels = windows[:, 1:]
    return float(-jnp.mean(jnp.take_along_axis(log_p, labels[..., None], axis=-1)))


def divergence(reference, log_p) -> float:
    """The mean KL divergence of a model's next-character distribution (`log_p`)
    from the reference model's."""
    return float(jnp.mean(jnp.sum(jnp.exp(reference) * (reference - log_p), axis=-1)))
