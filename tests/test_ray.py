"""`jaxbuf.ray` (issue 51): a ReplayService served to Ray actors in other
processes, against a model that accounts for every id.

One local Ray cluster for the module (`ray.init(address="local")`: a new
cluster with its own ports and session, so two xdist workers each running
this module never share or collide), with the checkout first on its
workers' PYTHONPATH. The callers are Ray actors (`tests/ray_actors.py`);
every remote call is waited for with a timeout (`WAIT`), and the callers
hand back what they saw, so each assertion is on what the remote caller
got.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

import ray

import jaxbuf  # noqa: E402
import jaxbuf.ray  # noqa: E402
from tests import ray_actors  # noqa: E402

WAIT = 120.0  # s: the longest the test waits for any remote call
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def cluster():
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  if ray.is_initialized():  # a cluster another test left behind (it failed)
    ray.shutdown()
  with warnings.catch_warnings():
    # JAX warns that forking its multithreaded process may deadlock; Ray
    # forks only to exec its own processes at once.
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    ray.init(
      address="local",
      num_cpus=2,
      include_dashboard=False,
      log_to_driver=False,
      runtime_env={"env_vars": {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}},
    )
  yield
  ray.shutdown()


@pytest.fixture(scope="module")
def callers(cluster):
  """Two caller processes, shared by the tests that kill none."""
  actors = [ray_actors.Caller.remote() for _ in range(2)]
  ray.get([actor.pid.remote() for actor in actors], timeout=WAIT)
  return actors


def get(refs):
  return ray.get(refs, timeout=WAIT)


def items_service(capacity=4096, limiter=None):
  buffer = jaxbuf.uniform_replay(capacity)
  state = buffer.init({"x": np.float32(0), "id": np.int32(0)})
  return jaxbuf.ReplayService(buffer, state, rate_limiter=limiter)


def held_ids(service) -> np.ndarray:
  state = service.state
  return np.asarray(state.storage["id"])[: int(state.size)]


def assert_each_once(ids: np.ndarray, expected: set) -> None:
  assert len(ids) == len(set(ids.tolist())), "an id twice"
  assert set(ids.tolist()) == expected


def chunk_ids(first_id, index, rows) -> set:
  start = first_id + index * rows
  return set(range(start, start + rows))


def read_log(path: pathlib.Path) -> tuple[set, set]:
  """A caller's log: chunks acknowledged, chunks sent and not acknowledged."""
  lines = path.read_text().split("\n") if path.exists() else []
  sent = {int(line.split()[1]) for line in lines if line.startswith("send")}
  acked = {int(line.split()[1]) for line in lines if line.startswith("ack")}
  return acked, sent - acked


def check_against_logs(service, runs) -> None:
  """Every acknowledged chunk held once; each unacknowledged chunk (at most
  one per caller, and the ones it had in flight) held whole or not at all; nothing else held; the
  limiter counted exactly what the state holds."""
  ids = held_ids(service)
  assert len(ids) == len(set(ids.tolist())), "an id twice"
  held = set(ids.tolist())
  expected = set()
  for first_id, rows, log, in_flight in runs:
    acked, unacked = read_log(log)
    assert len(unacked) <= 1 + in_flight, unacked
    for index in acked:
      assert chunk_ids(first_id, index, rows) <= held, f"acknowledged chunk {index} lost"
      expected |= chunk_ids(first_id, index, rows)
    for index in unacked:
      part = chunk_ids(first_id, index, rows) & held
      assert part in (set(), chunk_ids(first_id, index, rows)), "a chunk held in part"
      expected |= part
  assert held == expected, f"ids no caller sent: {sorted(held - expected)[:5]}"
  assert service.counts.inserts == len(ids)


# Packaging --------------------------------------------------------------------


def test_import_jaxbuf_does_not_import_ray():
  code = "import sys, jaxbuf; assert 'ray' not in sys.modules; import jaxbuf.ray; print('ok')"
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  result = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=WAIT
  )
  assert result.stdout.strip() == "ok", result.stderr


def test_the_handle_pickles_and_a_writer_does_not(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  assert served.service is service
  name, message = get(callers[0].pickled_writer.remote(served))
  assert name == "TypeError" and "belongs to the thread" in message
  name, message = get(callers[0].from_two_threads.remote(served))
  assert name == "RuntimeError" and "belongs to thread" in message
  served.close()


def test_connect_finds_a_served_service_by_name():
  service = items_service()
  service.writer().add(ray_actors.chunk(0, 3))
  served = jaxbuf.ray.serve(service, name="found-by-name")
  found = jaxbuf.ray.connect("found-by-name", timeout=WAIT)
  assert found.service is None and found.counts == service.counts
  with pytest.raises(TimeoutError):
    jaxbuf.ray.connect("served-by-nobody", timeout=0.5)
  with pytest.raises(ValueError, match="served already"):
    jaxbuf.ray.serve(items_service(), name="found-by-name")
  served.close()


# Adds, versions and samples across processes -----------------------------------


def test_remote_writers_lose_nothing_and_carry_their_versions(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  runs = [(10_000 * (i + 1), 20, 8, 100 * i) for i in range(2)]
  refs = [
    caller.add_chunks.remote(served, first, chunks, rows, version=version)
    for caller, (first, chunks, rows, version) in zip(callers, runs)
  ]
  for outcomes in get(refs):
    assert outcomes == [("ok", None)] * 20
  expected = set().union(*(set(range(f, f + c * r)) for f, c, r, _ in runs))
  assert_each_once(held_ids(service), expected)
  assert service.counts.inserts == 320
  # version of id: its run's version + its chunk; the newest is 100 + 19.
  status, (batch, lag) = get(callers[0].sample.remote(served, 0, 64))
  assert status == "ok"
  ids = batch.items["id"]
  versions = np.where(ids >= 20_000, 100 + (ids - 20_000) // 8, (ids - 10_000) // 8)
  np.testing.assert_array_equal(lag, 119 - versions)
  status, (_, lag) = get(callers[1].sample.remote(served, 1, 64, max_version_lag=3))
  assert status == "ok" and lag.max() <= 3
  served.close()


def test_a_remote_add_waits_for_the_limiter_as_a_local_one(callers):
  limiter = jaxbuf.SampleToInsertRatio(1.0, min_size=8, error_buffer=8.0)
  service = items_service(limiter=limiter)
  served = jaxbuf.ray.serve(service)
  writer = service.writer()
  for first_id in range(0, 16, 4):  # diff 16: the window's top
    writer.add(ray_actors.chunk(first_id, 4))
  assert get(callers[0].blocked_add.remote(served, 100, 4, 0.5))[0] == "TimeoutError"
  assert service.counts.inserts == 16  # the refused add counted nothing
  waiting = callers[0].blocked_add.remote(served, 100, 4, 30.0)
  time.sleep(0.5)
  assert service.counts.inserts == 16  # still held back
  service.sample(jax.random.key(0), 8, timeout=5.0)
  assert get(waiting) == ("ok", None)
  assert_each_once(held_ids(service), set(range(16)) | set(range(100, 104)))
  served.close()


def test_close_ends_every_remote_call_with_service_closed(callers):
  never = items_service(limiter=jaxbuf.MinSize(10**6))  # samples wait for ever
  full = items_service(limiter=jaxbuf.Queue(4))  # adds wait once 4 are unread
  full.writer().add(ray_actors.chunk(0, 4))
  served_never, served_full = jaxbuf.ray.serve(never), jaxbuf.ray.serve(full)
  sampling = callers[0].sample.remote(served_never, 0, 4, timeout=None)
  adding = callers[1].blocked_add.remote(served_full, 10, 2, None)
  time.sleep(1.0)
  assert not ray.wait([sampling, adding], timeout=0)[0]  # both blocked
  served_never.close()
  full.close()  # a local close reaches the remote callers too
  assert get(sampling)[0] == "ServiceClosed"
  assert get(adding)[0] == "ServiceClosed"
  # Later calls: the writer claim and the sample are refused in the caller.
  assert get(callers[0].sample.remote(served_never, 0, 4))[0] == "ServiceClosed"
  assert get(callers[1].claim.remote(served_full, None, 5.0))[0] == "ServiceClosed"


def test_a_remote_close_closes_the_learners_service(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  assert get(callers[0].close.remote(served)) == ("ok", None)
  assert service.closed
  with pytest.raises(jaxbuf.ServiceClosed):
    service.writer()


def test_malformed_items_raise_the_buffers_error_in_the_caller(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  good = ray_actors.chunk(0, 4)
  cases = [
    (dict(good, x=np.zeros((4, 2), np.float32)), "ValueError", "['x']"),
    ({"x": good["x"]}, "TypeError", "id"),
    (dict(good, x=np.array(["a", "b", "c", "d"])), "TypeError", "items['x']"),
    (dict(good, id=np.array([object()] * 4)), "TypeError", "items['id']"),
    (dict(good, x="four floats"), "TypeError", "items['x']"),
  ]
  for index, (items, error, leaf) in enumerate(cases):
    (name, message), after = get(callers[index % 2].add_items.remote(served, items, 100 + index))
    assert (name, leaf in message) == (error, True), (name, message)
    assert after == ("ok", None)  # the writer and the service go on
  assert_each_once(held_ids(service), set(range(100, 100 + len(cases))))
  assert service.counts.inserts == len(cases)
  served.close()


def test_with_a_chunk_in_flight_errors_come_with_the_next_add(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  bad = dict(ray_actors.chunk(0, 2), x=np.zeros((2, 3), np.float32))
  first, second, third, flushed = get(callers[0].in_flight_error.remote(served, bad))
  assert first == ("ok", None)  # sent; its error is not known yet
  assert second[0] == "ValueError" and "['x']" in second[1]
  assert third == ("ok", None) and flushed == ("ok", None)
  assert_each_once(held_ids(service), {500, 501, 502, 503})
  served.close()


# Streams: env rows owned across processes ----------------------------------------


def test_stream_writers_own_their_env_rows_across_processes(callers):
  buffer = jaxbuf.sequence_replay(4, 4 * 64, 4)
  service = jaxbuf.ReplayService(buffer, buffer.init({"x": np.float32(0)}))
  served = jaxbuf.ray.serve(service)
  refs = [
    callers[0].steps.remote(served, [0, 1], 0, 30),
    callers[1].steps.remote(served, [2, 3], 0, 30),
  ]
  assert get(refs) == [30, 30]
  assert get(callers[0].claim.remote(served, [1, 2], 0.5))[0] == "ok"  # now free: all closed
  name, message = get(callers[1].claim.remote(served, [2, 3], 0.5))
  assert name == "ValueError" and "belong to another writer" in message
  sample = service.sample(jax.random.key(0), 64, timeout=5.0).batch
  windows = np.asarray(sample.items["x"])  # [S, 4]: one env's consecutive steps
  np.testing.assert_array_equal(np.diff(windows, axis=1), 1.0)
  envs = np.asarray(sample.indices) // 64
  np.testing.assert_array_equal(windows[:, 0] // 1000, envs)
  served.close()


# Faults ---------------------------------------------------------------------------


def kill(actor, how: str) -> None:
  if how == "ray.kill":
    ray.kill(actor)
  else:
    os.kill(get(actor.pid.remote()), signal.SIGKILL)


def wait_for_ack(log: pathlib.Path, timeout: float = WAIT) -> None:
  deadline = time.monotonic() + timeout
  while not read_log(log)[0]:
    assert time.monotonic() < deadline, "no add acknowledged"
    time.sleep(0.05)


def run_kills(service, served, survivor, kills: int, tmp_path, seed: int) -> None:
  """`kills` callers killed mid-add, at random moments, by `ray.kill` and
  SIGKILL in turn, each with its own chunk size, every other one with a
  chunk in flight, while `survivor` adds throughout; then every log
  against the state."""
  rng = np.random.default_rng(seed)
  runs = [(1, 7, tmp_path / "survivor.log", 0)]
  surviving = survivor.logged_adds.remote(served, 1, 7, str(runs[0][2]))
  for index in range(kills):
    first_id, rows = 10**6 * (index + 1), int(rng.integers(1, 65))
    log, in_flight = tmp_path / f"killed{index}.log", index % 2
    runs.append((first_id, rows, log, in_flight))
    actor = ray_actors.Caller.remote()
    actor.logged_adds.remote(served, first_id, rows, str(log), max_in_flight=in_flight)
    wait_for_ack(log)
    time.sleep(float(rng.uniform(0.0, 0.2)))
    kill(actor, "ray.kill" if index % 4 < 2 else "SIGKILL")
  served.close()  # the survivor stops with ServiceClosed, nothing hangs
  assert get(surviving) >= 1
  check_against_logs(service, runs)


def test_a_killed_actor_loses_at_most_its_unacknowledged_chunk(callers, tmp_path):
  service = items_service(capacity=2**16)
  served = jaxbuf.ray.serve(service)
  run_kills(service, served, callers[0], 4, tmp_path, seed=0)


@pytest.mark.slow
def test_a_thousand_killed_actors_lose_no_acknowledged_insert(callers, tmp_path):
  service = items_service(capacity=2**22)
  served = jaxbuf.ray.serve(service)
  run_kills(service, served, callers[0], 1000, tmp_path, seed=1)


def test_a_killed_stream_writers_env_rows_are_freed(callers):
  buffer = jaxbuf.sequence_replay(4, 4 * 64, 4)
  service = jaxbuf.ReplayService(buffer, buffer.init({"x": np.float32(0)}))
  served = jaxbuf.ray.serve(service)
  holder = ray_actors.Caller.remote()
  assert get(holder.claim.remote(served, [0, 1], 30.0)) == ("ok", [0, 1])
  kill(holder, "SIGKILL")
  assert get(callers[0].claim.remote(served, [0, 1], 30.0)) == ("ok", [0, 1])
  assert get(callers[1].steps.remote(served, [2, 3], 0, 5)) == 5  # the rest unaffected
  served.close()


def test_close_at_a_random_moment_loses_no_acknowledged_add(callers, tmp_path):
  rng = np.random.default_rng(7)
  service = items_service(capacity=2**16)
  served = jaxbuf.ray.serve(service)
  runs = [(10**6 * (i + 1), int(rng.integers(1, 65)), tmp_path / f"{i}.log", i) for i in range(2)]
  refs = [
    caller.logged_adds.remote(served, first, rows, str(log), max_in_flight=in_flight)
    for caller, (first, rows, log, in_flight) in zip(callers, runs)
  ]
  wait_for_ack(runs[0][2])
  time.sleep(float(rng.uniform(0.0, 0.5)))
  served.close()
  assert all(count >= 0 for count in get(refs))
  check_against_logs(service, runs)


def test_a_learner_restarted_from_a_checkpoint_takes_its_actors_back(callers, tmp_path):
  name = "restarted-learner"
  limiter = jaxbuf.MinSize(1)
  service = items_service(capacity=2**14, limiter=limiter)
  served = jaxbuf.ray.serve(service, name=name)
  get(callers[0].add_chunks.remote(served, 0, 10, 5))  # ids 0..49, acknowledged
  service.checkpoint(tmp_path / "checkpoint")
  log = tmp_path / "reconnecting.log"
  adding = callers[1].reconnecting_adds.remote(served, 1000, 4, 30, str(log))
  wait_for_ack(log)
  # The learner's process is lost: its broker dies; what it took after the
  # checkpoint is lost with it.
  ray.kill(ray.get_actor(name, namespace=served.namespace))
  buffer = jaxbuf.uniform_replay(2**14)
  like = buffer.init({"x": np.float32(0), "id": np.int32(0)})
  restored = jaxbuf.ReplayService.restore(tmp_path / "checkpoint", buffer, like, limiter)
  assert restored.counts.inserts == 50
  served_again = jaxbuf.ray.serve(restored, name=name)
  assert get(adding) >= 1  # it reconnected at least once
  acked, unacked = read_log(log)
  assert acked == set(range(30))
  ids = held_ids(restored)
  assert len(ids) == len(set(ids.tolist()))
  held = set(ids.tolist())
  assert set(range(50)) <= held  # the checkpoint's
  after = held - set(range(50))
  assert after <= set(range(1000, 1120))
  # Chunks acknowledged by the restored learner are held: the last chunks.
  assert chunk_ids(1000, 29, 4) <= after
  assert restored.counts.inserts == len(ids)
  served_again.close()
  served.close()


def start_learner(folder: pathlib.Path, name: str, mode: str) -> subprocess.Popen:
  """tests/ray_learner.py in its own process, joined to this cluster."""
  context = ray.get_runtime_context()
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  script = str(ROOT / "tests" / "ray_learner.py")
  arguments = [context.gcs_address, context.namespace, name, str(folder), mode]
  process = subprocess.Popen(
    [sys.executable, script, *arguments], env=dict(os.environ, PYTHONPATH=path)
  )
  wait_for_file(folder / f"{mode}.ready", process)
  return process


def wait_for_file(path: pathlib.Path, process: subprocess.Popen) -> None:
  deadline = time.monotonic() + WAIT
  while not path.exists():
    assert process.poll() is None, f"the learner exited with {process.returncode}"
    assert time.monotonic() < deadline, f"no {path.name} within {WAIT} s"
    time.sleep(0.05)


@pytest.mark.slow
def test_a_sigkilled_learner_process_restarts_from_its_checkpoint(callers, tmp_path):
  """The learner in its own process, SIGKILLed after a checkpoint while an
  actor adds; a new learner process restores the checkpoint and serves the
  same name; the actor's writer reconnects and every chunk acknowledged by
  the new learner is held, once, beside the checkpoint's."""
  name = "sigkilled-learner"
  first = start_learner(tmp_path, name, "first")
  served = jaxbuf.ray.connect(name, timeout=WAIT)
  log = tmp_path / "adds.log"
  adding = callers[0].reconnecting_adds.remote(served, 0, 4, 60, str(log))
  deadline = time.monotonic() + WAIT
  while len(read_log(log)[0]) < 10:
    assert time.monotonic() < deadline
    time.sleep(0.05)
  before = max(read_log(log)[0])  # acknowledged before the checkpoint began
  (tmp_path / "checkpoint.now").touch()
  wait_for_file(tmp_path / "checkpoint.done", first)
  time.sleep(0.3)  # adds after the checkpoint: lost with the learner
  first.send_signal(signal.SIGKILL)
  first.wait(WAIT)
  second = start_learner(tmp_path, name, "restore")
  try:
    assert get(adding) >= 1  # reconnected
    (tmp_path / "stop.now").touch()
    second.wait(WAIT)
  finally:
    if second.poll() is None:
      second.kill()
  restored = set(np.load(tmp_path / "restored_ids.npy").tolist())
  final = np.load(tmp_path / "final_ids.npy")
  assert len(final) == len(set(final.tolist())), "an id twice"
  held = set(final.tolist())
  acked, _ = read_log(log)
  assert acked == set(range(60))
  for index in range(before + 1):  # acknowledged before the checkpoint: in it
    assert chunk_ids(0, index, 4) <= restored
  assert restored <= held and held <= set(range(240))
  assert chunk_ids(0, 59, 4) <= held  # acknowledged by the restored learner
  assert int(np.load(tmp_path / "final_counts.npy")[0]) == len(final)


# Remote samplers and parameters ----------------------------------------------------


def test_a_remote_sampler_updates_priorities(callers):
  buffer = jaxbuf.prioritized_replay(64, alpha=1.0)
  service = jaxbuf.ReplayService(buffer, buffer.init({"x": np.float32(0), "id": np.int32(0)}))
  service.writer().add(ray_actors.chunk(0, 64))
  served = jaxbuf.ray.serve(service)
  raised = set(get(callers[0].update.remote(served, 3, 4, 1000.0)).tolist())
  drawn = np.asarray(service.sample(jax.random.key(1), 512, timeout=5.0).batch.indices)
  assert np.isin(drawn, list(raised)).mean() > 0.9  # 4 rows hold 4000 of 4060
  served.close()


def test_parameters_are_published_to_actors(callers):
  service = items_service()
  served = jaxbuf.ray.serve(service)
  waiting = callers[0].latest.remote(served, -1, 30.0)
  served.publish({"w": np.arange(3.0)}, version=1)
  params, version = get(waiting)
  assert version == 1 and params["w"].tolist() == [0.0, 1.0, 2.0]
  assert get(callers[1].latest.remote(served, 1, 0.2)) is None  # nothing newer
  waiting = callers[1].latest.remote(served, 1, 30.0)
  served.publish({"w": np.arange(3.0) + 1}, version=2)
  params, version = get(waiting)
  assert version == 2 and params["w"].tolist() == [1.0, 2.0, 3.0]
  served.close()


# The example ---------------------------------------------------------------------


def test_the_ray_dqn_example_runs():
  ray_dqn = pytest.importorskip("examples.ray_dqn")
  config = ray_dqn.Config(
    total_steps=600,
    num_envs=4,
    num_actors=2,
    buffer_size=256,
    batch_size=8,
    learning_starts=64,
    hidden_size=16,
    target_update_interval=8,
    steps_per_add=4,
    actor_cpus=0.0,
    error_buffer=64.0,
  )
  result = ray_dqn.train(config)  # on the module's cluster
  assert result["env_steps"] >= 600
  assert result["updates"] > 0
  assert abs(result["samples_per_insert"] - result["target_samples_per_insert"]) < 0.5


@pytest.mark.slow
def test_the_ray_dqn_example_solves_cartpole():
  from examples import ray_dqn  # pylint: disable=import-outside-toplevel

  result = ray_dqn.train(ray_dqn.Config())
  assert result["final_mean_return"] >= 475, result["final_mean_return"]
  achieved, target = result["samples_per_insert"], result["target_samples_per_insert"]
  assert abs(achieved - target) / target < 0.01
