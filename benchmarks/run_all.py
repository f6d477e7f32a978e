"""Run every benchmark script and print all their tables.

    python benchmarks/run_all.py [--quick] [--repeats N] [--cold] [--in-process] [--only NAME ...]

Each script runs in its own Python process (so no script sees the caches or the
memory another one left), with the flags given here passed on. `--in-process`
imports and runs them one after another in this process instead, which saves
starting JAX once per script (the smoke test uses it with `--quick`). Exits with
status 1 if any script failed, after running the others.
"""

import argparse
import importlib
import os
import subprocess
import sys
import time
import traceback


SCRIPTS = (
    "trace_time",
    "eager_ops",
    "compile_run",
    "nested",
    "memory",
    "quantized",
    "calibration",
    "qat",
    "float8_step",
    "w8a8",
    "qlora",
    "depth_scaling",
    "scale",
    "soak",
    "instructions",
)
HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Run every benchmark script.")
    parser.add_argument("--in-process", action="store_true", help="run the scripts in this process")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, help="run only these scripts")
    args, passed_on = parser.parse_known_args(argv)

    failed = []
    start = time.perf_counter()
    for name in args.only or SCRIPTS:
        print(f"<!-- benchmarks/{name}.py {' '.join(passed_on)} -->", flush=True)
        began = time.perf_counter()
        if args.in_process:
            if HERE not in sys.path:
                sys.path.insert(0, HERE)
            try:
                importlib.import_module(name).main(passed_on)
            except SystemExit as exit_:
                if exit_.code not in (0, None):
                    failed.append(name)
            except Exception:
                traceback.print_exc()
                failed.append(name)
        else:
            script = os.path.join(HERE, f"{name}.py")
            status = subprocess.run([sys.executable, script, *passed_on]).returncode
            if status != 0:
                failed.append(name)
        print(f"<!-- {name}: {time.perf_counter() - began:.1f} s -->\n", flush=True)
    print(f"<!-- all: {time.perf_counter() - start:.1f} s -->")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
