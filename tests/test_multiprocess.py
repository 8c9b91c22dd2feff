"""`jaxbuf.sharded` across 2 processes on localhost, 2 CPU devices each.

The processes (tests/multiprocess_worker.py) join through
`jax.distributed.initialize`, so the buffer spans 4 devices owned by two
JAX clients, as it would span hosts; each adds only its own rows. Then both
save the state to one path (each writing its own shards) and load it back,
and checkpoints move between process counts: one saved here (one process)
loads in the two, and theirs loads here, over any number of devices.
"""

import os
import re
import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxbuf
from tests import devices

devices.skip_module_unless(4)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
LOCAL = 8  # slots per device: capacity 32 over 4 devices


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def run_workers(out_dir, worker: str = WORKER) -> None:
  """Runs 2 `worker` processes to completion; they write `out_dir/process_<i>.npz`."""
  env = dict(os.environ)
  # The test session's 4 fake devices must not leak into the workers, which
  # ask for 2 each through jax_num_cpu_devices.
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  port = str(free_port())
  workers = [
    subprocess.Popen(
      [sys.executable, worker, str(i), "2", port, str(out_dir)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  for process in workers:
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-3000:]


# The workers' buffer (tests/multiprocess_worker.py), here in one process.
INNER = jaxbuf.prioritized_replay(4 * LOCAL, alpha=0.7, beta=0.5)
EXAMPLE = {"obs": jnp.zeros(64, jnp.float32), "serial": jnp.int32(0)}
TARGETS = {
  "four": jaxbuf.sharded(INNER, jax.make_mesh((4,), ("data",))),
  "two": jaxbuf.sharded(INNER, jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])),
  "unsharded": INNER,
}


def one_process_state():
  """A wrapped state over the 4 devices with uneven priorities (one process)."""
  four = TARGETS["four"]
  state = four.init(EXAMPLE)
  for start in range(0, 44, 4):
    serial = np.arange(start, start + 4, dtype=np.int32)
    state = four.add(
      state, {"obs": np.repeat(serial[:, None], 64, 1).astype(np.float32), "serial": serial}
    )
  return four.update_priorities(
    state, np.arange(4 * LOCAL, dtype=np.int32), (np.arange(4 * LOCAL, dtype=np.float32) % 5) ** 2
  )


@pytest.fixture(scope="module")
def workers_output(tmp_path_factory):
  """The folder and what each worker saw, from one run shared by the tests."""
  out_dir = tmp_path_factory.mktemp("processes")
  jaxbuf.save(out_dir / "one_process", one_process_state())
  run_workers(out_dir)
  return out_dir, [dict(np.load(out_dir / f"process_{i}.npz")) for i in range(2)]


def test_two_processes_share_one_buffer(workers_output):
  first, second = workers_output[1]
  assert int(first["num_devices"]) == 4 and int(first["local_devices"]) == 2
  # Both processes see the same batches, replicated or gathered from shards.
  for name in (
    "indices",
    "serials",
    "weights",
    "split_serials",
    "leaves",
    "storage",
    "whole_indices",
    "loaded_indices",
    "loaded_serials",
    "loaded_weights",
  ):
    np.testing.assert_array_equal(first[name], second[name], err_msg=name)
  np.testing.assert_array_equal(first["split_serials"], first["whole_serials"])
  # Each device holds its own rows: process p's serials on its 2 devices.
  storage = first["storage"]  # [4, 8]
  assert np.all(storage[:2] < 1000) and np.all(storage[2:] >= 1000)
  # Rows are those of the slots drawn.
  flat = storage.reshape(-1)
  np.testing.assert_array_equal(first["serials"], flat[first["indices"]])
  # The distribution over items of both processes: p ** alpha / global sum.
  leaves = first["leaves"][:, :LOCAL].reshape(-1).astype(np.float64)
  counts = np.bincount(first["indices"].reshape(-1), minlength=leaves.size)
  held = leaves > 0
  assert counts[~held].sum() == 0
  expected = leaves[held] / leaves[held].sum() * counts.sum()
  assert scipy.stats.chisquare(counts[held], expected).pvalue > 1e-3
  assert counts[:16].sum() > 0 and counts[16:].sum() > 0


def test_two_processes_save_and_load_one_sharded_state(workers_output):
  """Each process writes and verifies its own shards; errors reach both."""
  out_dir, seen = workers_output
  for process, outcome in enumerate(seen):
    # Every shard held comes back bit for bit, on its device.
    assert bool(outcome["restored_same"]), process
    # The loaded state samples the batch the saved one did, in both processes.
    for name in ("indices", "serials", "weights"):
      np.testing.assert_array_equal(
        outcome[f"loaded_{name}"], outcome[f"whole_{name}"], err_msg=name
      )
    # Different paths: one clear error in both, and nothing written.
    assert str(outcome["disagree_error"]).startswith(
      "ValueError: save: the processes disagree on the path: process 0 has "
      f"{out_dir / 'checkpoint'}-0, process 1 has {out_dir / 'checkpoint'}-1"
    ), outcome["disagree_error"]
    assert list(outcome["leftovers"]) == ["checkpoint", "checkpoint.jaxbuf-lock"]
    # A bit flipped in process 1's data file: process 1 finds it, and process
    # 0 stops with the same message rather than return a half-checked state.
    error = str(outcome["corrupted_error"])
    assert error.startswith("ValueError: load: "), error
    assert re.search(
      r"(checksum mismatch at|stored arrays of) leaf "
      r"\.storage\['obs'\]",
      error,
    ), error
  assert "process 1 failed (ValueError), so every process stops" in str(seen[0]["corrupted_error"])
  # Where the flipped bit lands depends on how the shard's file was laid out
  # (written concurrently): in array bytes, jaxbuf's checksum names the piece;
  # elsewhere in the file, TensorStore's own read fails, and its reason is
  # given, never orbax's wrapper text.
  found_by_process_1 = str(seen[1]["corrupted_error"])
  assert re.search(
    r"piece \[[23]:[34], 0:8, 0:64\] \(restored on device|cannot be read.*corrupted or edited: ",
    found_by_process_1,
  ), found_by_process_1
  assert "bound method" not in found_by_process_1, found_by_process_1


def held(state):
  """{serial: sum-tree leaf} of every item a state holds, stacked or not."""
  size = np.asarray(state.size).reshape(-1)
  serials = np.asarray(state.storage["serial"]).reshape(size.shape[0], -1)
  leaves = np.asarray(state.sum_tree.levels[0]).reshape(size.shape[0], -1)
  return {
    int(serials[d, slot]): float(leaves[d, slot])
    for d, count in enumerate(size)
    for slot in range(count)
  }


def test_checkpoints_move_between_process_counts(workers_output, tmp_path):
  """Saved by one process, loaded by two over 4 devices, over 2 (one per
  process) and unsharded: every leaf as one process loads it. Saved by two
  processes, loaded by one: bit for bit over 4 devices, every item, leaf
  and counter regrouped over 2 and unsharded."""
  out_dir, seen = workers_output
  for name, buffer in TARGETS.items():
    expected = jax.tree.leaves(
      jax.device_get(jaxbuf.load(out_dir / "one_process", like=buffer.init(EXAMPLE)))
    )
    for process, outcome in enumerate(seen):
      for i, leaf in enumerate(expected):
        np.testing.assert_array_equal(
          outcome[f"one_process_{name}_{i}"], leaf, err_msg=f"{name} {i} process {process}"
        )
  like = TARGETS["four"].init(EXAMPLE)
  saved = jax.tree.unflatten(
    jax.tree.structure(like), [seen[0][f"saved_{i}"] for i in range(len(jax.tree.leaves(like)))]
  )
  loaded = {
    name: jax.device_get(jaxbuf.load(out_dir / "two_processes", like=buffer.init(EXAMPLE)))
    for name, buffer in TARGETS.items()
  }
  chex.assert_trees_all_equal(loaded["four"], saved)
  for name, state in loaded.items():
    assert held(state) == held(saved), name
    assert int(np.sum(state.add_count)) == int(np.sum(saved.add_count)), name
    assert np.max(state.max_priority) == np.max(saved.max_priority), name
    assert np.ravel(state.beta_step)[0] == np.ravel(saved.beta_step)[0], name
