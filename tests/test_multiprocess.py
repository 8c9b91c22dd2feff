"""`jaxbuf.sharded` across 2 processes on localhost, 2 CPU devices each.

The processes (tests/multiprocess_worker.py) join through
`jax.distributed.initialize`, so the buffer spans 4 devices owned by two
JAX clients, as it would span hosts; each adds only its own rows.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import scipy.stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
LOCAL = 8  # slots per device: capacity 32 over 4 devices


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def test_two_processes_share_one_buffer(tmp_path):
  env = dict(os.environ)
  # The test session's 4 fake devices must not leak into the workers, which
  # ask for 2 each through jax_num_cpu_devices.
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  port = str(free_port())
  workers = [subprocess.Popen(
      [sys.executable, WORKER, str(i), "2", port, str(tmp_path)], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  for worker in workers:
    output, _ = worker.communicate(timeout=240)
    assert worker.returncode == 0, output[-3000:]
  seen = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2)]
  first, second = seen
  assert int(first["num_devices"]) == 4 and int(first["local_devices"]) == 2
  # Both processes see the same batches, replicated or gathered from shards.
  for name in ("indices", "serials", "weights", "split_serials", "leaves",
               "storage"):
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
