"""`jaxbuf.sharded` across 2 processes on localhost, 2 CPU devices each.

The processes (tests/multiprocess_worker.py) join through
`jax.distributed.initialize`, so the buffer spans 4 devices owned by two
JAX clients, as it would span hosts; each adds only its own rows. Then both
save the state to one path (each writing its own shards) and load it back.
"""

import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
LOCAL = 8  # slots per device: capacity 32 over 4 devices


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def run_workers(out_dir) -> None:
  """Runs the 2 workers to completion; they write `out_dir/process_<i>.npz`."""
  env = dict(os.environ)
  # The test session's 4 fake devices must not leak into the workers, which
  # ask for 2 each through jax_num_cpu_devices.
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  port = str(free_port())
  workers = [subprocess.Popen(
      [sys.executable, WORKER, str(i), "2", port, str(out_dir)], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  for worker in workers:
    output, _ = worker.communicate(timeout=240)
    assert worker.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def workers_output(tmp_path_factory):
  """The folder and what each worker saw, from one run shared by the tests."""
  out_dir = tmp_path_factory.mktemp("processes")
  run_workers(out_dir)
  return out_dir, [dict(np.load(out_dir / f"process_{i}.npz")) for i in range(2)]


def test_two_processes_share_one_buffer(workers_output):
  first, second = workers_output[1]
  assert int(first["num_devices"]) == 4 and int(first["local_devices"]) == 2
  # Both processes see the same batches, replicated or gathered from shards.
  for name in ("indices", "serials", "weights", "split_serials", "leaves",
               "storage", "whole_indices", "loaded_indices", "loaded_serials",
               "loaded_weights"):
    np.testing.assert_array_equal(first[name], second[name], err_msg=name)
  np.testing.assert_array_equal(first["split_serials"], first["whole_serials"])
  # Each device holds its own rows: process p's serials on its 2 devices.
  storage = first["storage"]                                   # [4, 8]
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
      np.testing.assert_array_equal(outcome[f"loaded_{name}"],
                                    outcome[f"whole_{name}"], err_msg=name)
    # Different paths: one clear error in both, and nothing written.
    assert str(outcome["disagree_error"]).startswith(
        "ValueError: save: the processes disagree on the path: process 0 has "
        f"{out_dir / 'checkpoint'}-0, process 1 has {out_dir / 'checkpoint'}-1"), (
            outcome["disagree_error"])
    assert list(outcome["leftovers"]) == ["checkpoint", "checkpoint.jaxbuf-lock"]
    # A bit flipped in process 1's data file: process 1 finds it, and process
    # 0 stops with the same message rather than return a half-checked state.
    error = str(outcome["corrupted_error"])
    assert error.startswith("ValueError: load: "), error
    assert re.search(r"(checksum mismatch at|stored arrays of) leaf "
                     r"\.storage\['obs'\]", error), error
  assert "process 1 failed (ValueError), so every process stops" in str(
      seen[0]["corrupted_error"])
  assert re.search(r"piece \[[23]:[34], 0:8, 0:64\] \(restored on device",
                   str(seen[1]["corrupted_error"]))
