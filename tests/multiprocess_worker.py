"""One of the processes `tests/test_multiprocess.py` starts: 2 CPU devices each.

Usage: python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Joins the others through `jax.distributed`, makes one prioritized buffer
sharded over every process's devices, adds only this process's rows, sets
uneven priorities, samples globally (replicated and sharded batches) and
writes what it saw to `OUT_DIR/process_<id>.npz` for the parent to compare.
"""

import os
import sys

import numpy as np

CAPACITY = 32
ALPHA = 0.7
ROUNDS = 3  # adds of 4 rows per device (12 rows per process)
BATCH = 16
DRAWS = 300  # batches for the distribution
# Floats per observation: a device's rows (8 x 64 x 4 bytes) are too large for
# the checkpoint's index to hold inline, so each process's rows land in data
# files of its own, as real observations would.
OBS = 64


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_num_cpu_devices", 2)
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=num_processes, process_id=process_id
  )
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  import jaxbuf  # pylint: disable=import-outside-toplevel

  num_devices = jax.device_count()
  local_devices = jax.local_device_count()
  mesh = jax.make_mesh((num_devices,), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  inner = jaxbuf.prioritized_replay(CAPACITY, alpha=ALPHA, beta=0.5)
  buffers = {batch: jaxbuf.sharded(inner, mesh, batch=batch) for batch in ("replicated", "sharded")}
  buffer = buffers["replicated"]
  state = buffer.init({"obs": jnp.zeros(OBS, jnp.float32), "serial": jnp.int32(0)})

  per_process = 4 * local_devices  # rows this process adds per round
  for round_index in range(ROUNDS):
    # Serial numbers say which process and round wrote a row.
    serial = 1000 * process_id + 100 * round_index + np.arange(per_process, dtype=np.int32)
    obs = np.sin(serial[:, None] * np.arange(1.0, OBS))
    local = {"obs": np.concatenate([serial[:, None], obs], 1).astype(np.float32), "serial": serial}
    items = jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, x), local)
    state = buffer.add(state, items)

  # Every slot is held (12 rows per device, 8 slots); uneven priorities,
  # the same arguments on every process.
  priorities = (np.arange(CAPACITY, dtype=np.float32) % 7) ** 2
  state = buffer.update_priorities(state, np.arange(CAPACITY, dtype=np.int32), priorities)

  keys = jax.random.split(jax.random.key(7), DRAWS)
  many = jax.jit(lambda s, ks: jax.lax.map(lambda k: buffer.sample(s, k, BATCH), ks))(state, keys)
  indices = np.asarray(many.indices.addressable_data(0))  # replicated
  serials = np.asarray(many.items["serial"].addressable_data(0))
  weights = np.asarray(many.weights.addressable_data(0))
  split = buffers["sharded"].sample(state, jax.random.key(1), BATCH)
  whole = buffer.sample(state, jax.random.key(1), BATCH)
  # The sharded batch, gathered: the same batch as the replicated one.
  split_serials = multihost_utils.process_allgather(split.items["serial"], tiled=True)
  leaves = multihost_utils.process_allgather(state.sum_tree.levels[0], tiled=True)
  storage = multihost_utils.process_allgather(state.storage["serial"], tiled=True)
  regroups = regrouped_loads(inner, state, out_dir)
  checkpoint = checkpoint_round_trip(
    buffer, state, jax.random.key(1), os.path.join(out_dir, "checkpoint"), process_id
  )
  np.savez(
    os.path.join(out_dir, f"process_{process_id}.npz"),
    indices=indices,
    serials=serials,
    weights=weights,
    split_serials=np.asarray(split_serials),
    whole_indices=np.asarray(whole.indices.addressable_data(0)),
    whole_serials=np.asarray(whole.items["serial"].addressable_data(0)),
    whole_weights=np.asarray(whole.weights.addressable_data(0)),
    leaves=np.asarray(leaves),
    storage=np.asarray(storage),
    num_devices=num_devices,
    local_devices=local_devices,
    **checkpoint,
    **regroups,
  )
  jax.distributed.shutdown()


def regrouped_loads(inner, state, out_dir: str) -> dict[str, np.ndarray]:
  """Saves `state` (this job's, 4 devices) to `OUT_DIR/two_processes`, and
  loads what the parent saved in one process (`OUT_DIR/one_process`) over
  the 4 devices, over 2 (one per process) and unsharded; every leaf of
  each, gathered, and of `state`, for the parent to compare bit for bit."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  import jaxbuf  # pylint: disable=import-outside-toplevel

  def gathered(leaf):
    if leaf.is_fully_replicated:
      return np.asarray(leaf.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))

  def leaves(prefix, tree):
    return {f"{prefix}_{i}": gathered(leaf) for i, leaf in enumerate(jax.tree.leaves(tree))}

  example = {"obs": jnp.zeros(OBS, jnp.float32), "serial": jnp.int32(0)}
  jaxbuf.save(os.path.join(out_dir, "two_processes"), state)
  targets = {
    "four": jaxbuf.sharded(inner, jax.make_mesh((4,), ("data",))),
    "two": jaxbuf.sharded(inner, jax.make_mesh((2,), ("data",), devices=jax.devices()[::2])),
    "unsharded": inner,
  }
  seen = leaves("saved", state)
  for name, buffer in targets.items():
    seen.update(
      leaves(
        f"one_process_{name}",
        jaxbuf.load(os.path.join(out_dir, "one_process"), like=buffer.init(example)),
      )
    )
  return seen


def outcome(call) -> str:
  """`call()`'s exception as "Type: message", or "" if it returned."""
  try:
    call()
  except Exception as error:  # pylint: disable=broad-except
    return f"{type(error).__name__}: {error}"
  return ""


def checkpoint_round_trip(buffer, state, key, path: str, process_id: int) -> dict[str, np.ndarray]:
  """Saves, loads into a fresh state, samples; then a bit flipped in one shard.

  Every outcome is recorded rather than asserted, so that a failure in one
  process never leaves the other waiting: the parent compares.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  import jaxbuf  # pylint: disable=import-outside-toplevel

  def fresh():
    return buffer.init({"obs": jnp.zeros(OBS, jnp.float32), "serial": jnp.int32(0)})

  jaxbuf.save(path, state)
  restored = jaxbuf.load(path, like=fresh())
  # Every shard this process holds: same device, same slice, same bytes.
  same = all(
    got.sharding.is_equivalent_to(want.sharding, got.ndim)
    and all(
      g.device == w.device
      and g.index == w.index
      and np.asarray(g.data).tobytes() == np.asarray(w.data).tobytes()
      for g, w in zip(got.addressable_shards, want.addressable_shards)
    )
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state))
  )
  again = buffer.sample(restored, key, 16)
  # The processes pass different paths: one clear error in both.
  disagree = outcome(lambda: jaxbuf.save(f"{path}-{process_id}", state))
  # Process 1 flips one bit in the largest file of its own shards.
  multihost_utils.sync_global_devices("checkpoint: loaded")
  if process_id == 1:
    own = os.path.join(path, "state", "ocdbt.process_1", "d")
    victim = max((os.path.join(own, name) for name in os.listdir(own)), key=os.path.getsize)
    with open(victim, "r+b") as file:
      file.seek(os.path.getsize(victim) // 2)
      byte = file.read(1)[0]
      file.seek(-1, os.SEEK_CUR)
      file.write(bytes([byte ^ 0x10]))
  multihost_utils.sync_global_devices("checkpoint: corrupted")
  corrupted = outcome(lambda: jaxbuf.load(path, like=fresh()))
  return {
    "restored_same": same,
    "loaded_indices": np.asarray(again.indices.addressable_data(0)),
    "loaded_serials": np.asarray(again.items["serial"].addressable_data(0)),
    "loaded_weights": np.asarray(again.weights.addressable_data(0)),
    "disagree_error": disagree,
    "corrupted_error": corrupted,
    "leftovers": sorted(
      name for name in os.listdir(os.path.dirname(path)) if name.startswith("checkpoint")
    ),
  }


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
