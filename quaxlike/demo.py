"""`python -m quaxlike.demo`: QLoRA fine-tuning of a small transformer.

A character-level transformer is first trained (all of it, in float32) on text
made of sentences about animals ("the big fox chases the cat."), which this
module generates. Its linear layers are then quantised to 4 bits and given LoRA
updates (`qlora`), which alone are trained on new text about machines ("the old
rover maps the probe."). The demo prints the trainable parameters, the loss
before and after, a sample of generated text, the peak memory of one training
step (from XLA's `memory_analysis()`) against fine-tuning the whole float32
model, at this size and at a width where the weights dominate, and checks that
no weight was ever dequantised whole.

Needs optax (`pip install "quaxlike[demo]"`). About half a minute on two CPU
cores, most of it compiling.
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


try:
    import optax
except ModuleNotFoundError as error:  # the demo's one dependency beyond quaxlike's
    raise SystemExit(
        "The demo needs optax, which quaxlike itself does not: install it with "
        '`pip install "quaxlike[demo]"` (or `pip install ".[demo]"` from a checkout).'
    ) from error

import quaxlike
from quaxlike.lora import partition, qlora
from quaxlike.quantized import largest_dequantized, QuantizedArray


# --- the text --------------------------------------------------------------------

_GRAMMAR = {
    "animals": {
        "adjective": ["big", "small", "red", "old", "shy"],
        "noun": ["cat", "dog", "fox", "bird", "cow", "hen"],
        "verb": ["sees", "likes", "chases", "finds", "hears"],
    },
    "machines": {
        "adjective": ["big", "small", "red", "old", "new"],
        "noun": ["robot", "drone", "rover", "probe", "crane"],
        "verb": ["scans", "maps", "tracks", "fixes", "lifts"],
    },
}


def sentences(topic: str, n: int, seed: int) -> str:
    """`n` sentences 'the <adjective> <noun> <verb> the <noun>.' about `topic`."""
    words = _GRAMMAR[topic]
    rng = np.random.default_rng(seed)
    pick = lambda kind: words[kind][rng.integers(len(words[kind]))]  # noqa: E731
    return "".join(
        f"the {pick('adjective')} {pick('noun')} {pick('verb')} the {pick('noun')}. "
        for _ in range(n)
    )


ALPHABET = sorted(set(sentences("animals", 400, 0) + sentences("machines", 400, 0)))


def encode(text: str) -> np.ndarray:
    return np.array([ALPHABET.index(c) for c in text], np.int32)


def batches(text: str, length: int, size: int, seed: int):
    """Endless batches of `size` windows of `length + 1` characters of `text`."""
    codes = encode(text)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(codes) - length - 1, size)
        yield jnp.asarray(np.stack([codes[s : s + length + 1] for s in starts]))


# --- the model -------------------------------------------------------------------


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key):
        k1, k2, k3 = jr.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x, mask):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda h: self.down(jax.nn.gelu(self.up(h))))(h)


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, length: int, width: int, depth: int, heads: int, key):
        keys = jr.split(key, depth + 3)
        self.embedding = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.position = 0.02 * jr.normal(keys[1], (length, width))
        self.blocks = [Block(width, heads, k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=keys[2])

    def __call__(self, tokens):
        """Next-character logits `(length, vocab)` for `tokens` `(length,)`."""
        x = jax.vmap(self.embedding)(tokens) + self.position[: len(tokens)]
        mask = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(lambda h: self.head(self.norm(h)))(x)


def build(seed: int) -> Transformer:
    """A new model, its weights drawn by NumPy as Equinox draws them: uniform in
    `+-1 / sqrt(fan_in)` for linear layers, standard normal for the embedding;
    ones and zeros for the layer norms. (Equinox's own initialisers would
    compile a JAX program for every shape: seconds.)"""
    shapes = eqx.filter_eval_shape(
        Transformer, len(ALPHABET), LENGTH, WIDTH, DEPTH, HEADS, jr.key(0)
    )
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        names = [key.name for key in path if isinstance(key, jax.tree_util.GetAttrKey)]
        if names[0] in ("embedding", "position"):
            values = rng.standard_normal(x.shape) * (1.0 if names[0] == "embedding" else 0.02)
        elif len(x.shape) == 1:  # biases, and the layer norms' scales
            values = np.full(x.shape, 1.0 if names[-1] == "weight" else 0.0)
        else:
            bound = 1 / np.sqrt(x.shape[-1])
            values = rng.uniform(-bound, bound, x.shape)
        return jnp.asarray(values.astype(x.dtype))

    return jax.tree_util.tree_map_with_path(fill, shapes)


def logits_fn(model, windows):
    """Next-character logits for a batch of windows `(batch, length)`."""
    return jax.vmap(quaxlike.quaxify(model))(windows)


def loss_fn(model, batch):
    """Mean cross-entropy of the next character, over a batch of windows of
    `length + 1` characters."""
    logits = logits_fn(model, batch[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))


# --- compiling, training, measuring ------------------------------------------------


def _is_array(x) -> bool:
    # Arrays, or their shapes and dtypes (to compile for a model never built).
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_float(x) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def full(model):
    """Everything floating-point trains (fine-tuning the whole float32 model)."""
    return eqx.partition(model, _is_float)


def compiled(fn, *args):
    """`jax.jit(fn)` compiled for `args` (arrays, or `jax.ShapeDtypeStruct`s),
    with the rest of `args` (the model's functions and flags) held fixed; and
    the traced program. Compiling once and calling the result keeps JAX from
    tracing again on every call."""
    arrays, static = eqx.partition(args, _is_array)
    traced = jax.jit(lambda arrays: fn(*eqx.combine(arrays, static))).trace(arrays)
    program = traced.lower().compile()
    return lambda *args: program(eqx.filter(args, _is_array)), program, traced.jaxpr


def training_step(model, trainable_of, learning_rate: float, batch):
    """One compiled training step of the part of `model` that `trainable_of`
    picks (adam), its first arguments, and its traced program."""
    trainable, frozen = trainable_of(model)
    optimiser = optax.adam(learning_rate)

    def step(trainable, opt_state, frozen, batch):
        # The frozen part is an argument, not a constant of the program, so that
        # XLA counts it in the step's memory.
        loss = lambda t: loss_fn(eqx.combine(t, frozen), batch)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value

    opt_state = eqx.filter_eval_shape(optimiser.init, trainable)
    if all(map(eqx.is_array, jax.tree_util.tree_leaves(trainable))):
        opt_state = optimiser.init(trainable)
    args = (trainable, opt_state, frozen, batch)
    run, program, jaxpr = compiled(step, *args)
    return run, program, jaxpr, args


def train(model, trainable_of, text: str, steps: int, learning_rate: float, seed: int):
    """`steps` steps of adam on `text`; the model, and the step's program."""
    data = batches(text, LENGTH, BATCH, seed)
    run, program, jaxpr, args = training_step(model, trainable_of, learning_rate, next(data))
    trainable, opt_state, frozen, _ = args
    for _ in range(steps):
        trainable, opt_state, _ = run(trainable, opt_state, frozen, next(data))
    return eqx.combine(trainable, frozen), program, jaxpr


def peak_bytes(program) -> int:
    """Arguments + outputs + temporaries - aliased: the bytes a compiled program
    needs at its peak, as XLA plans it."""
    stats = program.memory_analysis()
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def step_peaks(width: int) -> tuple[int, int]:
    """Peak bytes of a QLoRA step and of a full fine-tuning step, for the model
    at another width (compiled for its shapes only: nothing is built or run)."""
    shapes = eqx.filter_eval_shape(
        Transformer, len(ALPHABET), LENGTH, width, DEPTH, HEADS, jr.key(0)
    )
    quantized = eqx.filter_eval_shape(lambda m: qlora(m, rank=RANK, key=jr.key(1)), shapes)
    batch = jax.ShapeDtypeStruct((BATCH, LENGTH + 1), jnp.int32)
    return (
        peak_bytes(training_step(quantized, partition, 1e-2, batch)[1]),
        peak_bytes(training_step(shapes, full, 1e-2, batch)[1]),
    )


def generate(logits, model, prompt: str, n: int) -> str:
    """`n` characters after `prompt`, each the most likely next one."""
    codes = list(encode(prompt))
    for _ in range(n):
        recent = codes[-LENGTH:]
        windows = np.zeros((BATCH, LENGTH), np.int32)
        windows[0, : len(recent)] = recent
        codes.append(int(jnp.argmax(logits(model, jnp.asarray(windows))[0, len(recent) - 1])))
    return "".join(ALPHABET[c] for c in codes)


def _count(tree) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x))


LENGTH, BATCH, WIDTH, DEPTH, HEADS, RANK = 32, 16, 128, 2, 4, 8
BIG = 1024  # the width at which the memory is compared too


def main(steps: int = 150, pretrain_steps: int | None = None, compare_width: int = BIG) -> None:
    """Pre-train on the first text for `pretrain_steps` steps (default
    `steps`), then fine-tune with QLoRA on the second for `steps`. Memory is
    also compared at `compare_width`, where the weights dominate (`0`: not)."""
    start = time.perf_counter()
    pretrain_steps = steps if pretrain_steps is None else pretrain_steps
    animals, machines = sentences("animals", 400, 1), sentences("machines", 400, 2)

    model = build(seed=0)
    model, full_step, _ = train(model, full, animals, pretrain_steps, 1e-2, 0)

    # Every Linear's weight: a LoRA update over a 4-bit Int4Array.
    tuned = qlora(model, rank=RANK, key=jr.key(1), scale=0.02)
    held_out = next(batches(sentences("machines", 100, 3), LENGTH, BATCH, 4))
    logits, _, _ = compiled(logits_fn, tuned, held_out[:, :-1])

    def loss(model):
        out = logits(model, held_out[:, :-1])
        return float(
            jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, held_out[:, 1:]))
        )

    before = loss(tuned)
    tuned, qlora_step, jaxpr = train(tuned, partition, machines, steps, 1e-2, 5)
    after = loss(tuned)

    # Nothing densified: every conversion of integer codes to floating point in
    # the training step's program makes at most half of the largest weight (each
    # product dequantises its weight in two blocks or more).
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    weights = [x for x in jax.tree_util.tree_leaves(tuned, is_leaf=is_quantized) if is_quantized(x)]
    biggest, largest = max(w.size for w in weights), largest_dequantized(jaxpr)
    trainable, total = _count(partition(tuned)[0]), _count(full(model)[0])
    qlora_peak, full_peak = peak_bytes(qlora_step), peak_bytes(full_step)

    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(
        f"QLoRA fine-tuning of a {DEPTH}-block character transformer (width {WIDTH}): "
        f"its {len(weights)} linear layers in 4 bits, with LoRA updates of rank {RANK}"
    )
    print(f"  trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.1f}%)")
    print(f"  held-out loss on the new text: {before:.3f} before, {after:.3f} after {steps} steps")
    print(f"  sample: {generate(logits, tuned, 'the old ', 36)!r}")
    print(
        f"  peak memory of a training step (XLA's memory_analysis()): {mib(qlora_peak)}, "
        f"against {mib(full_peak)} to fine-tune the float32 model ({qlora_peak / full_peak:.2f}x);"
    )
    if compare_width:
        big_qlora, big_full = step_peaks(compare_width)
        print(
            f"    at width {compare_width}, where the weights outweigh the activations: "
            f"{mib(big_qlora)} against {mib(big_full)} ({big_qlora / big_full:.2f}x)"
        )
    print(
        f"  nothing densified: the training step dequantises at most {largest:,} "
        f"values at once; the largest weight has {biggest:,}"
    )
    print(f"  ({time.perf_counter() - start:.0f} s)")
    assert 0 < largest <= biggest // 2, "a weight was dequantised whole"
    assert after < before, "the loss should go down"


if __name__ == "__main__":
    main()
