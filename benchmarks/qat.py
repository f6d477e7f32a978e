"""Quantisation-aware training against post-training quantisation: the held-out
loss of a small trained language model quantised to 4, 3 and 2 bits after the
same short fine-tuning, in float32 then rounded to nearest (PTQ), or with the
weights fake-quantised (QAT) then converted by `quantize`.

The model and data are `benchmarks/calibration.py`'s: the demo's character
transformer (`quaxlike.demo`: width 128, 2 blocks, 13 `eqx.nn.Linear`
weights), trained in float32 with adam (lr 1e-2) for `--steps` steps on the
demo's sentences about animals and machines, measured on held-out sentences of
the same grammar. It is then fine-tuned for `--qat-steps` steps of adam (lr
`--lr`) on the same text, four ways, and quantised with groups of
`--group-size`:

- **float FT, then RTN** (PTQ): every float leaf fine-tuned, then
  `quantize(model, bits=..., group_size=...)`.
- **QAT**: `fake_quantize(model, bits=..., group_size=...)`, every float leaf
  fine-tuned through the fake-quantised weights, then `quantize` (the
  settings come from the fake-quantised weights).
- **float LoRA, then RTN base**: `loraify(model, rank=8)`, only the adapters
  trained, then the base weights rounded to nearest under the trained adapters.
- **QAT + LoRA**: `loraify(fake_quantize(model), rank=8)`, only the adapters
  trained over the fake-quantised base (torchtune's QAT + LoRA), then
  `quantize`: QLoRA over the real quantised base.

As torchao reports QAT, "recovered" is the fraction of PTQ's degradation that
QAT closes, against the float model fine-tuned the same way:
`(loss_ptq - loss_qat) / (loss_ptq - loss_float_ft)`, and the same for the mean
KL divergence from that float model's next-character distribution. So the
extra training is in the reference as well, and a gain is QAT's. The
round-to-nearest of the model before fine-tuning is printed too. Each QAT
model's loss is measured after `quantize`; that equals the fake-quantised
model's (printed as a check: the largest difference of any logit).

Run: `python benchmarks/qat.py [--steps 300] [--qat-steps 100] [--bits 4 3 2]
[--group-size 64] [--lr 1e-3] [--rank 8] [--quick]`. A few minutes on two CPU
cores, most of it compiling a training step per bit width.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from _language_model import divergence, LENGTH, log_probabilities, mean_loss

from quaxlike.demo import batches, build, full, logits_fn, sentences, train
from quaxlike.lora import LoraArray, loraify, partition
from quaxlike.quantized import fake_quantize, quantize, QuantizedArray


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training of the float model")
    parser.add_argument("--qat-steps", type=int, default=100, help="of each fine-tuning")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="of the fine-tuning")
    parser.add_argument("--rank", type=int, default=8, help="of the LoRA adapters")
    parser.add_argument("--quick", action="store_true", help="a smoke test: few steps, 4 bits")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.qat_steps, args.bits = 20, 5, [4]
    start = time.perf_counter()

    text = sentences("animals", 600, 1) + sentences("machines", 600, 2)
    model, _, _ = train(build(seed=0), full, text, args.steps, 1e-2, 0)
    held_out_text = sentences("animals", 100, 3) + sentences("machines", 100, 4)
    held_out = jnp.concatenate([b for b, _ in zip(batches(held_out_text, LENGTH, 64, 5), range(4))])

    def fine_tuned(model, trainable_of):
        return train(model, trainable_of, text, args.qat_steps, args.lr, 7)[0]

    def lora(model):
        return loraify(model, rank=args.rank, key=jr.key(1))

    pretrained = log_probabilities(model, held_out)
    tuned = fine_tuned(model, full)
    tuned_lora = fine_tuned(lora(model), partition)
    references = {
        "full": log_probabilities(tuned, held_out),
        "lora": log_probabilities(tuned_lora, held_out),
    }
    print(
        f"character transformer (width 128, 2 blocks) trained for {args.steps} steps; "
        f"fine-tuned for {args.qat_steps} steps of adam at lr {args.lr} (LoRA rank "
        f"{args.rank}); groups of {args.group_size}; recovered: of PTQ's gap to the "
        "float model fine-tuned the same way"
    )
    print(
        "| bits | fine-tuning | quantised by | held-out loss | gap to float | of PTQ's gap "
        "recovered | KL from float | of PTQ's KL recovered |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(f"| float32 | none | | {mean_loss(pretrained, held_out):.4f} | | | | |")
    for kind, name in (("full", "full"), ("lora", "LoRA")):
        loss = mean_loss(references[kind], held_out)
        print(f"| float32 | {name} | | {loss:.4f} | | | | |")
    checks = []
    for bits in args.bits:
        rows = {}

        def report(kind, fine_tuning, method, q):
            reference = references.get(kind, pretrained)
            log_p = log_probabilities(q, held_out)
            loss, kl = mean_loss(log_p, held_out), divergence(reference, log_p)
            gap = loss - mean_loss(reference, held_out)
            rows[kind, method] = gap, kl
            share = ""
            if method == "qat":
                ptq_gap, ptq_kl = rows[kind, "rtn"]
                share = f"{1 - gap / ptq_gap:.0%} | {kl:.5f} | {1 - kl / ptq_kl:.0%}"
            else:
                share = f" | {kl:.5f} | "
            print(f"| {bits} | {fine_tuning} | {method} | {loss:.4f} | {gap:+.4f} | {share} |")

        report("none", "none", "rtn", quantize(model, bits=bits, group_size=args.group_size))
        report("full", "full", "rtn", quantize(tuned, bits=bits, group_size=args.group_size))
        qat = fine_tuned(fake_quantize(model, bits=bits, group_size=args.group_size), full)
        converted = quantize(qat)
        report("full", "full", "qat", converted)
        checks.append(_largest_difference(qat, converted, held_out))

        bases = quantize(model, bits=bits, group_size=args.group_size)
        report("lora", "LoRA", "rtn", _adapters_over(tuned_lora, bases))
        qat = lora(fake_quantize(model, bits=bits, group_size=args.group_size))
        qat = fine_tuned(qat, partition)
        converted = quantize(qat)
        report("lora", "LoRA", "qat", converted)
        checks.append(_largest_difference(qat, converted, held_out))
    print(
        f"largest difference of a logit between a fake-quantised model and its "
        f"`quantize`: {max(checks):.2e}"
    )
    print(f"({time.perf_counter() - start:.0f} s)")


def _adapters_over(lora_model, quantized):
    """`lora_model`'s adapters over `quantized`'s weights (the same layers)."""
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    bases = [x for x in jax.tree.leaves(quantized, is_leaf=is_quantized) if is_quantized(x)]

    def frozen(model):
        return [x.w for x in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(x)]

    return eqx.tree_at(frozen, lora_model, bases)


def _largest_difference(fake, converted, windows) -> float:
    a = eqx.filter_jit(logits_fn)(fake, windows[:, :-1])
    b = eqx.filter_jit(logits_fn)(converted, windows[:, :-1])
    return float(jnp.max(jnp.abs(a - b)))


if __name__ == "__main__":
    main()
