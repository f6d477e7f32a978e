"""How trace time grows with depth: `jax.make_jaxpr(quaxify(f))` of a stack of
`eqx.nn.Linear(width, width)` + relu layers at several depths, for the two cases
of `trace_time.py` (dense weights through the interpreter as `DenseArrayValue`s;
LoRA weights), each next to its plain-JAX counterpart (the plain model; the
hand-written LoRA maths).

Prints the median trace time per layer at each depth and the least-squares slope
of log(time) against log(depth): 1 means linear growth, which is what tracing a
straight-line program should cost. A slope clearly above 1 means some per-operation
cost grows with the size of the program traced so far.

Run: `python benchmarks/depth_scaling.py [--quick] [--repeats N] [--cold]`.
"""

import _harness as h
import numpy as np
from trace_time import dense_case, lora_case


def slope(depths, times):
    return float(np.polyfit(np.log(depths), np.log(times), 1)[0])


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=5)
    depths = (2, 4, 8) if args.quick else (8, 16, 32, 64, 128, 256)
    width = 16 if args.quick else 256
    h.print_header(
        "depth_scaling: trace time against depth",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu; cases as in trace_time.py; "
            "times are medians per layer",
        ],
    )
    medians = {key: [] for key in ("dense plain", "dense quax", "lora plain", "lora quax")}
    for depth in depths:
        for name, case in (("dense", dense_case), ("lora", lora_case)):
            paired = h.interleaved(*case(depth, width), args.repeats, cold=args.cold)
            medians[f"{name} plain"].append(paired.plain_median)
            medians[f"{name} quax"].append(paired.quax_median)

    table = h.Table(
        "Trace time per layer against depth",
        [
            "depth",
            "dense: plain JAX",
            "dense: quaxlike",
            "ratio",
            "lora: hand-written",
            "lora: quaxlike",
            "ratio",
        ],
    )
    for i, depth in enumerate(depths):
        per = {key: values[i] / depth for key, values in medians.items()}
        table.add(
            depth,
            h.fmt_time(per["dense plain"]),
            h.fmt_time(per["dense quax"]),
            f"{per['dense quax'] / per['dense plain']:.2f}",
            h.fmt_time(per["lora plain"]),
            h.fmt_time(per["lora quax"]),
            f"{per['lora quax'] / per['lora plain']:.2f}",
        )
    slopes = {key: slope(depths, values) for key, values in medians.items()}
    table.add(
        "log-log slope (target ≈ 1)",
        f"{slopes['dense plain']:.2f}",
        f"{slopes['dense quax']:.2f}",
        "",
        f"{slopes['lora plain']:.2f}",
        f"{slopes['lora quax']:.2f}",
        "",
    )
    table.print()


if __name__ == "__main__":
    main()
