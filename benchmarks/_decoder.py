"""The Llama-shaped decoder of `scale.py`, in Equinox, and the same model with its
LoRA written by hand in plain JAX (`HandLora`, `hand_lora`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from quaxlike.lora import LoraArray
from quaxlike.sharding import gathered


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's shape."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    seq: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SHAPES = {
    # Mistral-7B / Llama-2-7B-shaped (with grouped-query attention): 7.24 B parameters.
    "8b": Shape(
        "8B", dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, vocab=32000, seq=2048
    ),
    # Llama-2-70B-shaped: 68.98 B parameters.
    "70b": Shape(
        "70B", dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, vocab=32000, seq=2048
    ),
    # TinyLlama-1.1B-shaped: 1.10 B parameters.
    "1b": Shape(
        "1B", dim=2048, layers=22, heads=32, kv_heads=4, hidden=5632, vocab=32000, seq=2048
    ),
    # The smoke test's.
    "tiny": Shape("tiny", dim=128, layers=2, heads=4, kv_heads=2, hidden=256, vocab=256, seq=32),
}


# --- the model -----------------------------------------------------------------


class HandLora(eqx.Module):
    """A `Linear`'s weight `W` (frozen) and LoRA factors `A: (out, r)`, `B: (r, in)`,
    in plain JAX."""

    w: jax.Array
    a: jax.Array
    b: jax.Array


def project(linear: Any, x):
    """`x @ W.T` for a bias-free `eqx.nn.Linear` (whatever its weight is: an array, a
    `LoraArray`, a quantised array), or `x @ stop_gradient(W).T + (x @ B.T) @ A.T` for
    a `HandLora`, the order in which `LoraArray`'s rule computes it."""
    if isinstance(linear, HandLora):
        return x @ lax.stop_gradient(linear.w).T + (x @ linear.b.T) @ linear.a.T
    return x @ linear.weight.T


def rms_norm(x, weight, eps: float = 1e-5):
    """RMS normalisation of `x` over its last axis (in float32), scaled by `weight`."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * weight


def rotary(x, cos, sin):
    """Rotary position embedding of `x: (seq, heads, head_dim)`, halves rotated."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q, k, v, start):
    """Causal grouped-query attention of the queries `q: (n, kv_heads, group, head_dim)`
    at positions `start, ..., start + n - 1` over `k, v: (seq, kv_heads, head_dim)`:
    `(n, kv_heads, group, head_dim)`. Scores and softmax in float32."""
    n, seq = q.shape[0], k.shape[0]
    scores = jnp.einsum("tkgh,skh->kgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    causal = (start + jnp.arange(n))[:, None] >= jnp.arange(seq)[None, :]
    scores = jnp.where(causal, scores, jnp.float32(-1e30))
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("kgts,skh->tkgh", weights, v)


class Block(eqx.Module):
    """A decoder block: attention and SwiGLU feed-forward, each after an RMS norm."""

    attention_norm: jax.Array
    query: Any
    key: Any
    value: Any
    output: Any
    mlp_norm: jax.Array
    gate: Any
    up: Any
    down: Any
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, shape: Shape, key):
        d, kv = shape.dim, shape.kv_heads * shape.head_dim
        keys = jr.split(key, 7)
        linear = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=False, dtype=jnp.bfloat16, key=k)  # noqa: E731
        self.attention_norm = jnp.ones(d, jnp.bfloat16)
        self.query = linear(d, d, keys[0])
        self.key = linear(d, kv, keys[1])
        self.value = linear(d, kv, keys[2])
        self.output = linear(d, d, keys[3])
        self.mlp_norm = jnp.ones(d, jnp.bfloat16)
        self.gate = linear(d, shape.hidden, keys[4])
        self.up = linear(d, shape.hidden, keys[5])
        self.down = linear(shape.hidden, d, keys[6])
        self.heads, self.kv_heads = shape.heads, shape.kv_heads

    def __call__(self, x, cos, sin, chunk: int = 0, mlp_chunk: int = 0):
        """`x: (seq, dim)` through the block; `chunk`: queries per attention step,
        `mlp_chunk`: positions per feed-forward step (0: all at once)."""
        seq, d = x.shape
        head_dim = d // self.heads
        group = self.heads // self.kv_heads
        h = rms_norm(x, self.attention_norm)
        q = rotary(project(self.query, h).reshape(seq, self.heads, head_dim), cos, sin)
        k = rotary(project(self.key, h).reshape(seq, self.kv_heads, head_dim), cos, sin)
        v = project(self.value, h).reshape(seq, self.kv_heads, head_dim)
        q = q.reshape(seq, self.kv_heads, group, head_dim)
        if not chunk or chunk >= seq:
            attended = attention(q, k, v, 0)
        else:
            # Query chunks one after another, each under `jax.checkpoint`: the
            # backward pass recomputes a chunk's scores rather than keeping them.
            chunks = q.reshape(seq // chunk, chunk, *q.shape[1:])
            starts = jnp.arange(0, seq, chunk)
            step = jax.checkpoint(lambda c: attention(c[0], k, v, c[1]))
            attended = lax.map(step, (chunks, starts))
        x = x + project(self.output, attended.reshape(seq, d))
        h = rms_norm(x, self.mlp_norm)

        def mlp(h):
            return project(self.down, jax.nn.silu(project(self.gate, h)) * project(self.up, h))

        if not mlp_chunk or mlp_chunk >= seq:
            return x + mlp(h)
        # Positions a chunk at a time, each under `jax.checkpoint`, as attention.
        chunks = h.reshape(seq // mlp_chunk, mlp_chunk, d)
        return x + lax.map(jax.checkpoint(mlp), chunks).reshape(seq, d)


class Decoder(eqx.Module):
    """A Llama-shaped decoder over a sequence of token ids: next-token logits."""

    embedding: jax.Array
    blocks: Block  # stacked: every leaf has a leading axis of `layers`
    norm: jax.Array
    head: Any
    attention_chunk: int = eqx.field(static=True)
    loss_chunk: int = eqx.field(static=True)
    mlp_chunk: int = eqx.field(static=True)
    # Fully sharded data parallelism: the mesh whose devices each hold a slice of
    # every weight; each block's weights are gathered (as stored: packed codes)
    # inside the layer loop, and its input kept split by batch.
    layer_mesh: Any = eqx.field(static=True, default=None)
    # Layers per checkpoint of the residual stream (see `checkpointed_layers`): 1
    # saves every block's input for the backward pass, `k > 1` only every k-th.
    layers_per_checkpoint: int = eqx.field(static=True, default=1)

    def __init__(
        self,
        shape: Shape,
        key,
        *,
        attention_chunk: int = 0,
        loss_chunk: int = 0,
        mlp_chunk: int = 0,
        layer_mesh: Any = None,
        layers_per_checkpoint: int = 1,
    ):
        k_embed, k_blocks, k_head = jr.split(key, 3)
        self.embedding = jr.normal(k_embed, (shape.vocab, shape.dim), jnp.bfloat16)
        make = eqx.filter_vmap(lambda k: Block(shape, k))
        self.blocks = make(jr.split(k_blocks, shape.layers))
        self.norm = jnp.ones(shape.dim, jnp.bfloat16)
        self.head = eqx.nn.Linear(
            shape.dim, shape.vocab, use_bias=False, dtype=jnp.bfloat16, key=k_head
        )
        self.attention_chunk, self.loss_chunk = attention_chunk, loss_chunk
        self.mlp_chunk = mlp_chunk
        self.layer_mesh = layer_mesh
        self.layers_per_checkpoint = layers_per_checkpoint

    def hidden(self, tokens):
        """The final hidden states `(seq, dim)` of `tokens: (seq,)`."""
        x = self.embedding[tokens]
        seq, d = x.shape
        head_dim = d // self.blocks.heads
        frequencies = 10000.0 ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def block(x, leaves):
            if self.layer_mesh is not None:
                leaves = gathered(leaves, self.layer_mesh)
                # Under `jax.vmap(..., spmd_axis_name=...)`: split by batch only.
                whole = NamedSharding(self.layer_mesh, PartitionSpec())
                x = lax.with_sharding_constraint(x, whole)
            return eqx.combine(leaves, static)(x, cos, sin, self.attention_chunk, self.mlp_chunk)

        x = checkpointed_layers(block, x, dynamic, self.layers_per_checkpoint)
        return rms_norm(x, self.norm)

    def loss(self, tokens, targets):
        """The mean cross-entropy of `targets` under the logits at `tokens`."""
        hidden = self.hidden(tokens)
        seq = hidden.shape[0]
        chunk = self.loss_chunk if 0 < self.loss_chunk < seq else seq

        def losses(h, y):  # the summed cross-entropy at some positions
            logits = project(self.head, h).astype(jnp.float32)
            picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
            return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)

        if chunk == seq:
            return losses(hidden, targets) / seq
        # The logits of `chunk` positions at a time, each chunk under
        # `jax.checkpoint`: the backward pass recomputes them rather than keeping
        # all of them.
        step = jax.checkpoint(lambda total, c: (total + losses(*c), None))
        chunks = (hidden.reshape(seq // chunk, chunk, -1), targets.reshape(seq // chunk, chunk))
        total, _ = lax.scan(step, jnp.float32(0), chunks)
        return total / seq


def checkpointed_layers(block, x, stacked, layers_per_checkpoint: int = 1):
    """`x` through every layer of `stacked` in turn, `block(x, layer)` each, under
    `jax.checkpoint`: the backward pass recomputes what a layer computed from the
    residual stream saved at its input.

    With `layers_per_checkpoint = 1`, one `lax.scan` over checkpointed blocks: the
    stream is saved at every layer's input, `layers` of them. With `k > 1`, two
    levels: a scan over groups of `k` layers, each group under `jax.checkpoint`
    (only its input saved), around a scan over the group's layers, each under
    `jax.checkpoint` as before. The backward pass of a group first runs the group
    forward again, keeping its `k` layer inputs, then goes back through it layer
    by layer: `layers // k + k` residuals kept at once, at the cost of one more
    forward pass of every layer in a group. What `layers // k` groups leave over
    (`layers % k` layers) is scanned one layer at a time after them. The inner
    loop takes each layer out of the whole stack by its index, so that one
    layer's weights at a time are sliced (and gathered, in `block`), as in the
    one-level scan.

    **Arguments:**

    - `block`: `(x, layer) -> x`, one layer.
    - `x`: the residual stream at the first layer.
    - `stacked`: the layers' arrays and Values, each with a leading axis of
      `layers`.
    - `layers_per_checkpoint`: `k`, layers per saved residual (1: every layer; at
      most `layers`, one group of them all).

    **Returns:**

    The residual stream after the last layer.
    """
    layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    k = min(layers_per_checkpoint, layers)
    if k <= 1:
        return lax.scan(jax.checkpoint(lambda x, layer: (block(x, layer), None)), x, stacked)[0]

    @jax.checkpoint
    def layer(x, index):
        # The layer taken out of the whole stack by its index, inside the inner
        # loop. Scanning over the leaves split as `(groups, k, ...)` instead
        # makes XLA copy each group's slice for the inner loop (at 70B on two
        # devices, 1.6 GiB of codes live at the peak). Inside `quaxify` a Value
        # is indexed by its `dynamic_slice` rule, which keeps its layout (a
        # double-quantised NF4 weight's second-level scales one per block).
        one = jax.tree_util.tree_map(
            lambda leaf: lax.dynamic_index_in_dim(leaf, index, keepdims=False), stacked
        )
        return block(x, one), None

    @jax.checkpoint
    def group(x, first):
        return lax.scan(layer, x, first + jnp.arange(k))[0], None

    groups = layers // k
    x = lax.scan(group, x, k * jnp.arange(groups))[0]
    if layers % k:
        x = lax.scan(layer, x, jnp.arange(groups * k, layers))[0]
    return x


def _is_linear(x) -> bool:
    return isinstance(x, eqx.nn.Linear)


def hand_lora(model: Decoder) -> Decoder:
    """`model`, loraified, with each `Linear` over a `LoraArray` replaced by a
    `HandLora` holding the same `W`, `A` and `B`: the same model in plain JAX."""

    def plain(x):
        if _is_linear(x) and isinstance(x.weight, LoraArray):
            return HandLora(x.weight.w, x.weight.a, x.weight.b)
        return x

    return jax.tree_util.tree_map(plain, model, is_leaf=_is_linear)


def hand_trainable(model) -> Any:
    """`(trainable, frozen)` of a `hand_lora` model: the factors `A` and `B` of every
    `HandLora`, and the rest (as `partition` splits a loraified model)."""
    is_hand = lambda x: isinstance(x, HandLora)  # noqa: E731
    spec = jax.tree_util.tree_map(
        lambda x: HandLora(False, True, True) if is_hand(x) else False, model, is_leaf=is_hand
    )
    return eqx.partition(model, spec)
