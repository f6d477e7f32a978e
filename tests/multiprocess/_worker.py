"""One of the two processes of `test_distributed.py`:

    python _worker.py PROCESS_ID PORT KIND OUT_JSON

joins JAX's distributed runtime on 127.0.0.1:PORT with 4 CPU devices of its own
(8 in all), trains the `_training` model of KIND ("lora" or "qlora") on a mesh
across both processes, and writes its losses (and, from process 0, the trained
factors) to OUT_JSON.
"""

import json
import sys
import warnings

import jax


def main(process_id: int, port: int, kind: str, out: str) -> None:
    # Before JAX starts its backend: 4 CPU devices per process, and collectives
    # across processes over TCP (gloo: the default on JAX 0.10, named here for
    # releases where it may not be).
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",  # loopback only (default: all)
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=10,
    )
    # Imported after `initialize`: nothing may touch a device before it.
    import _training
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, PartitionSpec as P

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    # The batch and the weights are split over all 8 devices: across processes.
    assert {d.process_index for d in mesh.devices[:, 0]} == {0, 1}

    model, xs, ys = _training.place(_training.model(kind), *_training.data(), mesh)
    assert not xs.is_fully_addressable
    # FSDP: every weight split over all 8 devices of both processes, a QLoRA
    # weight's codes and scales along the same rows, and its `A` too.
    everywhere = P(("data", "model"))
    weight = model.layers[0].weight
    assert weight.a.sharding.spec == everywhere
    if kind == "qlora":
        assert weight.w.packed.sharding.spec == weight.w.scale.sharding.spec == everywhere
    trained, losses = _training.train(model, xs, ys)
    factors = multihost_utils.process_allgather(jax.tree.leaves(trained), tiled=True)
    result = {"losses": losses, "factors": [f.tolist() for f in factors]}
    with open(out, "w") as file:
        json.dump(result, file)
    jax.distributed.shutdown()


if __name__ == "__main__":
    # As in the test suite (pyproject.toml): warnings are errors, except optax's
    # import-time deprecations.
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"optax(\..*)?")
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
