"""Data-parallel training with JAX's own sharding: `fit(..., mesh=...)` replicates
the parameters and optimiser state over a mesh and splits each batch over it; in a
multi-process run only process 0 writes checkpoints and shows progress."""

from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._checks import is_int

DATA_AXIS = "data"

MeshSpec = Mesh | Literal["all"] | None


def data_mesh(
    devices: int | Sequence[jax.Device] | None = None, *, axis_name: str = DATA_AXIS
) -> Mesh:
    """A one-axis mesh for data-parallel training.

    **Arguments:**

    - `devices`: the devices to train on, or an `int` `n` for the first `n` of
        `jax.devices()`. By default all of `jax.devices()`, which after
        `jax.distributed.initialize` are the devices of every process.
    - `axis_name`: the name of the mesh's one axis.

    **Returns:**

    A `jax.sharding.Mesh` of shape `(len(devices),)`, to pass as `fit(..., mesh=...)`.

    !!! example

        ```python
        mesh = cnftrace.data_mesh(1)  # the first device; data_mesh() for all of them
        print(mesh.shape)  # {'data': 1}
        ```
    """
    available = jax.devices()
    if devices is None:
        devices = available
    elif is_int(devices):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"`devices` asks for {devices} devices, but {len(available)} are "
                f"available (jax.devices()); pass a number from 1 to {len(available)}."
            )
        devices = available[:devices]
    devices = list(devices)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device.")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError("`devices` lists a device more than once.")
    return Mesh(np.array(devices), (axis_name,), axis_types=(AxisType.Auto,))


class DataParallel:
    """How `fit` places its arrays on a mesh: the shardings, and helpers that put
    state on them. Built by `resolve_mesh`; `None` there means one device."""

    def __init__(self, mesh: Mesh):
        # `Auto` axes, so that `jax.make_mesh`'s explicit ones work too.
        self.mesh = Mesh(
            mesh.devices,
            mesh.axis_names,
            axis_types=(AxisType.Auto,) * len(mesh.axis_names),
        )
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        # The batch is split over every axis of the mesh (usually just one).
        self.batch = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))

    @property
    def size(self) -> int:
        """The number of devices the batch is split over."""
        return self.mesh.devices.size

    def replicate(self, tree):
        """`tree` with every array leaf replicated over the mesh, from host copies
        (which also works over several processes holding the same values)."""

        def put(x):
            if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
                return x
            host = np.asarray(x)
            return jax.make_array_from_callback(
                host.shape, self.replicated, lambda index: host[index]
            )

        return jax.tree_util.tree_map(put, tree)

    def shard_batch(self, tree):
        """Inside `jit`: split the leading (sample) axis of every leaf of `tree` over
        the mesh."""
        return jax.lax.with_sharding_constraint(tree, self.batch)

    def keep_replicated(self, tree):
        """Inside `jit`: keep every leaf of `tree` replicated."""
        return jax.lax.with_sharding_constraint(tree, self.replicated)


def resolve_mesh(mesh: MeshSpec) -> DataParallel | None:
    """`fit`'s `mesh` argument as a `DataParallel` placement, or `None` for one
    device."""
    if mesh is None:
        return None
    if isinstance(mesh, str) and mesh == "all":
        return DataParallel(data_mesh())
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "`mesh` must be None (one device), 'all' (every device in "
            "jax.devices()), or a jax.sharding.Mesh such as "
            f"`cnftrace.data_mesh(devices)`; got {mesh!r}."
        )
    if mesh.devices.size < 1:
        raise ValueError("`mesh` has no devices.")
    here = {d.id for d in jax.local_devices()}
    if not any(d.id in here for d in mesh.devices.flat):
        raise ValueError(
            f"`mesh` holds none of this process's devices (process "
            f"{jax.process_index()}); every process must take part in the mesh."
        )
    return DataParallel(mesh)


def check_batch_size(
    batch_size: int,
    num_devices: int,
    names: tuple[str, str] = ("`batch_size`", "`mesh`"),
) -> None:
    """A clear error unless `batch_size` splits evenly over `num_devices`. `names`:
    how the error calls the batch size and the devices (the CLI's flags, say)."""
    if batch_size % num_devices == 0:
        return
    lower = batch_size - batch_size % num_devices
    upper = lower + num_devices
    nearby = f"{lower} or {upper}" if lower > 0 else f"{upper}"
    divisors = [n for n in range(1, num_devices) if batch_size % n == 0]
    raise ValueError(
        f"{names[0]} must be a multiple of the number of devices in {names[1]} "
        f"({num_devices}), so that every device gets an equal share of each batch; "
        f"got {batch_size}. Use a batch size of {nearby} (any multiple of "
        f"{num_devices}), or train on {divisors[-1]} device(s)."
    )


def is_main_process() -> bool:
    """Whether this is process 0, the one that writes files and shows progress."""
    return jax.process_index() == 0


def check_same_on_all_processes(value, what: str) -> None:
    """In a multi-process run, a clear error unless every process has `value`."""
    if jax.process_count() == 1:
        return
    multihost_utils.assert_equal(
        np.asarray(value),
        fail_message=(
            f"the processes disagree on {what}; every process must see the same "
            "data, key and checkpoint directory (use a shared file system)."
        ),
    )
