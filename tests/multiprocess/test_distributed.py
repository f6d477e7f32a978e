"""Training across processes: two processes on this machine join JAX's
distributed runtime over loopback, each with 4 CPU devices, and train a LoRA
(or QLoRA) model with its batch and weights sharded over a mesh of all 8
devices. Their losses and trained factors must equal one process's.

The processes run `_worker.py`; the model, data, placement and training loop are
`_training.py`, which this test also runs in-process (one device) as the
reference. A run is killed when either process fails and after `TIMEOUT`
seconds, so a lost peer fails the test rather than hanging it.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import _training
import jax
import numpy as np
import pytest


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 150  # seconds; a run takes about 20 on two busy cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["QUAXLIKE_CHECK"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, ROOT, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def _two_processes(kind: str, tmp_path):
    """Start the two workers; yields a function that waits for both and returns
    their results. Leaving the block kills any worker still running."""
    port, env = _free_port(), _env()
    outs = [tmp_path / f"{kind}-{i}.json" for i in range(2)]
    logs = [open(tmp_path / f"{kind}-{i}.log", "w+") for i in range(2)]
    procs = []

    def wait() -> list[dict]:
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            # A failed process leaves its peer waiting in a collective: stop both.
            if any(p.returncode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the two processes did not finish in {TIMEOUT} s:\n{_tails(logs)}")
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs):
            codes = [p.returncode for p in procs]
            pytest.fail(f"a process failed (exit codes {codes}):\n{_tails(logs)}")
        return [json.loads(out.read_text()) for out in outs]

    try:
        for i in range(2):
            command = [sys.executable, os.path.join(HERE, "_worker.py")]
            command += [str(i), str(port), kind, str(outs[i])]
            procs.append(
                subprocess.Popen(
                    command, env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT
                )
            )
        yield wait
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()


def _tails(logs) -> str:
    parts = []
    for i, log in enumerate(logs):
        log.flush()
        log.seek(0)
        parts.append(f"--- process {i} ---\n{log.read()[-4000:]}")
    return "\n".join(parts)


def _check_against_one_process(kind: str, tmp_path) -> None:
    model = _training.model(kind)  # (fails here, before starting anything, if it cannot be built)
    with _two_processes(kind, tmp_path) as wait:
        # The reference, while they run: one process, one device, no mesh.
        trained, expected_losses = _training.train(model, *_training.data())
        results = wait()
    expected_factors = [np.asarray(x) for x in jax.tree.leaves(trained)]
    assert results[0]["losses"] == results[1]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == _training.STEPS and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    factors = [np.asarray(f, np.float32) for f in results[0]["factors"]]
    assert [f.shape for f in factors] == [f.shape for f in expected_factors]
    for got, expected in zip(factors, expected_factors):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the QLoRA test below takes the same path, and a quantised base too
def test_lora_training_across_two_processes(tmp_path):
    _check_against_one_process("lora", tmp_path)


def test_qlora_training_across_two_processes(tmp_path):
    _check_against_one_process("qlora", tmp_path)
