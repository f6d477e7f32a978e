"""Make `lora-finetuning-loss.png`: the training loss of the LoRA and QLoRA runs
of `lora-finetuning.md`, step by step.

It runs the page's own code (its Python blocks, in order), so the plot shows
exactly what the page computes. Needs matplotlib, which quaxlike does not
depend on:

    pip install matplotlib
    python docs/tutorials/lora_finetuning_loss.py
"""

import pathlib
import re

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


HERE = pathlib.Path(__file__).resolve().parent
PAGE = HERE / "lora-finetuning.md"
FIGURE = HERE / "lora-finetuning-loss.png"


def main() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, str(PAGE), "exec"), namespace)
    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    axes.plot(namespace["losses"], label="LoRA (float32 base)")
    axes.plot(namespace["qlora_losses"], label="QLoRA (4-bit base)", linestyle="--")
    axes.set_yscale("log")
    axes.set_xlabel("training step")
    axes.set_ylabel("mean squared error")
    axes.set_title("Fine-tuning an MLP with rank-4 updates")
    axes.legend()
    figure.tight_layout()
    figure.savefig(FIGURE, metadata={"Software": None})
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
