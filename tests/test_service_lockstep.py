"""`ReplayService(..., lockstep_rows=)`: a sharded item buffer served in
lockstep rounds (jaxbuf._src.service.lockstep), in one process over the 4
fake devices against a NumPy model, and across 2 processes on localhost
(tests/service_worker.py), as tests/test_multiprocess.py runs them."""

import os
import threading

import jax
import numpy as np
import pytest

import jaxbuf
from tests import devices
from tests.test_multiprocess import ROOT, run_workers

devices.skip_module_unless(4)

MESH_AXIS = ("data",)


def sharded(inner):
  return jaxbuf.sharded(inner, jax.make_mesh((4,), MESH_AXIS), batch="replicated")


def held(state) -> list[int]:
  storage = np.asarray(state.storage["serial"])
  size = np.asarray(state.size)
  return sorted(storage[np.arange(storage.shape[1]) < size[:, None]].tolist())


@pytest.mark.parametrize("inner", [jaxbuf.uniform_replay(64), jaxbuf.prioritized_replay(64)])
def test_rounds_add_every_row_once_from_many_writers(inner):
  """Two writer threads in adds of 5 and 3; blocks of 8 rows: every row
  lands exactly once (the NumPy model: the set of serials added), the
  counts are the limiter's, and samples draw only rows held."""
  buffer = sharded(inner)
  service = jaxbuf.ReplayService(
    buffer, buffer.init({"serial": np.int32(0)}), jaxbuf.MinSize(8), lockstep_rows=8
  )
  added = {0: list(range(0, 20)), 100: list(range(100, 124))}

  def actor(base, size):
    writer = service.writer()
    rows = added[base]
    for start in range(0, len(rows), size):
      writer.add({"serial": np.asarray(rows[start : start + size], np.int32)}, timeout=10)

  threads = [threading.Thread(target=actor, args=args) for args in ((0, 5), (100, 3))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  drawn = []
  for k in range(8):  # each round adds at most 8 rows: 44 rows need 6 rounds
    drawn.append(np.asarray(service.sample(jax.random.key(k), 4, timeout=10).batch.items["serial"]))
  model = sorted(added[0] + added[100])
  assert held(service.state) == model
  assert service.counts.inserts == 44 and service.counts.samples == 32
  assert set(np.concatenate(drawn).tolist()) <= set(model)
  sample = service.sample(jax.random.key(9), 4, timeout=10)
  assert sample.version_lag.tolist() == [-1] * 4  # versions are not tracked
  service.close()


def test_timeout_and_close_stop_the_round():
  buffer = sharded(jaxbuf.uniform_replay(64))
  service = jaxbuf.ReplayService(
    buffer, buffer.init({"serial": np.int32(0)}), jaxbuf.MinSize(8), lockstep_rows=8
  )
  with pytest.raises(TimeoutError, match="did not allow it within 0.05 s"):
    service.sample(jax.random.key(0), 4, timeout=0.05)
  service.close()
  with pytest.raises(jaxbuf.ServiceClosed):
    service.sample(jax.random.key(0), 4, timeout=1.0)


def test_lockstep_refuses_what_it_does_not_serve():
  example = {"serial": np.int32(0)}
  uniform = sharded(jaxbuf.uniform_replay(64))
  with pytest.raises(ValueError, match="not a jaxbuf.sharded buffer"):
    plain = jaxbuf.uniform_replay(64)
    jaxbuf.ReplayService(plain, plain.init(example), lockstep_rows=8)
  with pytest.raises(ValueError, match="jaxbuf.Queue"):
    jaxbuf.ReplayService(uniform, uniform.init(example), jaxbuf.Queue(16), lockstep_rows=8)
  windows = sharded(jaxbuf.sequence_replay(num_envs=4, capacity=64, sequence_length=2))
  with pytest.raises(ValueError, match="stream kinds: not yet"):
    jaxbuf.ReplayService(windows, windows.init(example), lockstep_rows=8)
  with pytest.raises(ValueError, match="divide by this process's 4 devices"):
    jaxbuf.ReplayService(uniform, uniform.init(example), lockstep_rows=6)
  with pytest.raises(ValueError, match="lockstep_rows must be an int >= 1"):
    jaxbuf.ReplayService(uniform, uniform.init(example), lockstep_rows=0)
  service = jaxbuf.ReplayService(uniform, uniform.init(example), lockstep_rows=8)
  writer = service.writer()
  with pytest.raises(ValueError, match="an add of 9 rows; lockstep_rows is 8"):
    writer.add({"serial": np.arange(9, dtype=np.int32)})
  with pytest.raises(ValueError, match=r"leaf \['serial'\] must be \[B, \*\(\)\] int32"):
    writer.add({"serial": np.zeros((2, 3), np.int32)})
  with pytest.raises(ValueError, match="max_version_lag is drawn by uniform item replay only"):
    service.sample(jax.random.key(0), 4, max_version_lag=1)
  assert service.counts.inserts == 0
  service.close()


def test_two_processes_add_their_own_rows_and_sample_in_lockstep(tmp_path):
  """Process 0 adds 40 rows in adds of 5, process 1 24 rows in adds of 3,
  slower; both sample in lockstep until the limiter refuses: the same
  batches, counts and timeout in both, and every row held once, on its
  own process's devices."""
  run_workers(tmp_path, worker=os.path.join(ROOT, "tests", "service_worker.py"))
  first, second = (dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2))
  for name in ("drawn", "storage", "size", "inserts", "samples", "timed_out", "checkpointed"):
    np.testing.assert_array_equal(first[name], second[name], err_msg=name)
  # 64 rows, then 10 + 3 pending that each process's checkpoint took in
  # the same rounds.
  assert int(first["inserts"]) == 77 == int(first["checkpointed"])
  # SampleToInsertRatio(1, min_size=8, error_buffer=16): samples stop at 64 + 8.
  assert int(first["samples"]) == 72 == 8 * len(first["drawn"])
  assert "within 1.0 s (in some process)" in str(first["timed_out"])
  storage, size = first["storage"], first["size"]
  rows = storage[np.arange(storage.shape[1]) < size[:, None]]
  expected = list(range(40)) + list(range(500, 510)) + list(range(1000, 1024))
  expected += list(range(1500, 1503))
  assert sorted(rows.tolist()) == expected
  # Devices 0-1 are process 0's, 2-3 process 1's: each holds its own rows.
  assert np.all(storage[:2][np.arange(32) < size[:2, None]] < 1000)
  assert np.all(storage[2:][np.arange(32) < size[2:, None]] >= 1000)
  assert set(first["drawn"].reshape(-1).tolist()) <= set(expected)


def test_a_checkpoint_holds_the_pending_adds_and_restores_in_lockstep(tmp_path):
  """Adds wait on the host until a round; a checkpoint runs the rounds that
  take them (every process calls it, as `sample`), so the saved state and
  the saved counts are one cut, and `restore(..., lockstep_rows=)` rebuilds
  the lockstep service."""
  buffer = sharded(jaxbuf.uniform_replay(64))
  like = buffer.init({"serial": np.int32(0)})
  service = jaxbuf.ReplayService(buffer, like, jaxbuf.MinSize(8), lockstep_rows=8)
  writer = service.writer()
  for start in range(0, 15, 5):  # 15 rows pending: more than one round's block of 8
    writer.add({"serial": np.arange(start, start + 5, dtype=np.int32)}, timeout=10)
  service.checkpoint(tmp_path / "cut")
  service.close()
  saved = jaxbuf.load(tmp_path / "cut" / "state", like=buffer.init({"serial": np.int32(0)}))
  assert held(saved) == list(range(15))
  restored = jaxbuf.ReplayService.restore(
    tmp_path / "cut",
    buffer,
    buffer.init({"serial": np.int32(0)}),
    jaxbuf.MinSize(8),
    lockstep_rows=8,
  )
  assert restored.counts.inserts == int(np.sum(restored.state.add_count)) == 15
  drawn = restored.sample(jax.random.key(0), 4, timeout=10).batch.items["serial"]
  assert set(np.asarray(drawn).tolist()) <= set(range(15))
  restored.writer().add({"serial": np.arange(100, 103, dtype=np.int32)}, timeout=10)
  restored.sample(jax.random.key(1), 4, timeout=10)  # its round adds them
  assert held(restored.state) == list(range(15)) + [100, 101, 102]
  assert restored.counts.inserts == 18 and restored.counts.samples == 8
  restored.close()
