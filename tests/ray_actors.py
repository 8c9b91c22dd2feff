"""The Ray actor that tests/test_ray.py runs its remote callers in.

Imported by reference in the actors' processes (the suite's Ray cluster
puts the checkout first on their PYTHONPATH), so it imports what the
public surface offers and nothing of the test module. Each remote call
hands back what it saw as values (an error as its type name and message),
so the tests assert on what the caller got, in the caller's process.
"""

import os
import threading
import time

import jax
import numpy as np
import ray

import jaxbuf

CALL = 60.0  # s: the longest any remote call here may wait


def chunk(first_id: int, rows: int) -> dict:
  """`rows` items with the unique ids first_id, first_id + 1, ..."""
  ids = np.arange(first_id, first_id + rows, dtype=np.int32)
  return {"x": ids.astype(np.float32), "id": ids}


def outcome(call, *args, **kwargs):
  """`("ok", result)` or `(error type name, message)`."""
  try:
    return ("ok", call(*args, **kwargs))
  except Exception as error:  # pylint: disable=broad-exception-caught
    return (type(error).__name__, str(error))


@ray.remote(num_cpus=0, max_concurrency=8)
class Caller:
  """Remote writers and samplers, one thread per call (a threaded actor)."""

  def pid(self) -> int:
    return os.getpid()

  def imported(self) -> list[str]:
    import sys  # pylint: disable=import-outside-toplevel

    return sorted(name for name in sys.modules if name.split(".")[0] in ("jaxbuf", "ray"))[:3]

  def add_chunks(self, served, first_id, chunks, rows, *, version=0, timeout=CALL, envs=None):
    """Adds `chunks` chunks of `rows` ids through one writer; the outcome of
    each add, in order (it stops at the first error)."""
    outcomes = []
    with served.writer(envs=envs, timeout=CALL) as writer:
      for index in range(chunks):
        outcomes.append(
          outcome(
            writer.add, chunk(first_id + index * rows, rows), policy_version=version + index,
            timeout=timeout,
          )
        )  # fmt: skip
        if outcomes[-1][0] != "ok":
          break
    return outcomes

  def add_items(self, served, items, good_first_id, *, timeout=CALL, envs=None, **kwargs):
    """One add of `items` (any pytree, malformed ones too), then one good
    add of one id through the same writer: both outcomes."""
    with served.writer(envs=envs, timeout=CALL) as writer:
      first = outcome(writer.add, items, timeout=timeout, **kwargs)
      return first, outcome(writer.add, chunk(good_first_id, 1), timeout=timeout)

  def blocked_add(self, served, first_id, rows, timeout):
    writer = served.writer(timeout=CALL)
    return outcome(writer.add, chunk(first_id, rows), timeout=timeout)

  def claim(self, served, envs, timeout):
    """Opens a writer on `envs` and keeps it open (the actor holds it)."""
    result = outcome(served.writer, envs=envs, timeout=timeout)
    if result[0] == "ok":
      self.held = result[1]
      return ("ok", self.held.envs.tolist())
    return result

  def steps(self, served, envs, first_step, count, timeout=CALL):
    """`count` single steps for each of `envs`, the step's id in `x`: env e's
    step t holds 1000 * e + first_step + t."""
    envs = np.asarray(envs)
    writer = served.writer(envs=envs, timeout=CALL)
    for t in range(count):
      step = {"x": (1000 * envs + first_step + t).astype(np.float32)}
      writer.add(step, policy_version=t, timeout=timeout)
    writer.close()
    return count

  def sample(self, served, seed, batch_size, *, timeout=CALL, max_version_lag=None):
    result = outcome(
      served.sample, jax.random.key(seed), batch_size, timeout=timeout,
      max_version_lag=max_version_lag,
    )  # fmt: skip
    if result[0] != "ok":
      return result
    sample = result[1]
    return ("ok", (jax.tree.map(np.array, sample.batch), np.array(sample.version_lag)))

  def update(self, served, seed, batch_size, priority):
    """Samples, then sets every sampled row's priority to `priority`."""
    sample = served.sample(jax.random.key(seed), batch_size, timeout=CALL)
    served.update_priorities(sample, np.full(batch_size, priority, np.float32))
    return np.array(sample.batch.indices)

  def counts(self, served):
    return tuple(served.counts)

  def close(self, served):
    return outcome(served.close)

  def latest(self, served, newer_than, timeout):
    return served.params(newer_than=newer_than, timeout=timeout)

  def logged_adds(self, served, first_id, rows, log_path, envs=None, max_in_flight=0):
    """Adds chunks until killed or closed, logging each chunk before it is
    sent ("send k") and once it is acknowledged ("ack k": when an add
    returns, all but the last `max_in_flight` chunks are), unbuffered, so
    the log survives a SIGKILL."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
      writer = served.writer(envs=envs, timeout=CALL, max_in_flight=max_in_flight)
      index = 0
      while True:
        os.write(log, f"send {index}\n".encode())
        writer.add(chunk(first_id + index * rows, rows), policy_version=index, timeout=CALL)
        if index >= max_in_flight:
          os.write(log, f"ack {index - max_in_flight}\n".encode())
        index += 1
    except jaxbuf.ServiceClosed:
      return index
    finally:
      os.close(log)

  def in_flight_error(self, served, bad_items):
    """With one chunk in flight, a bad chunk's error comes with the next
    add; a flush after a good chunk raises nothing."""
    writer = served.writer(timeout=CALL, max_in_flight=1)
    first = outcome(writer.add, bad_items, timeout=CALL)
    second = outcome(writer.add, chunk(500, 2), timeout=CALL)
    third = outcome(writer.add, chunk(502, 2), timeout=CALL)
    flushed = outcome(writer.flush)
    writer.close()
    return first, second, third, flushed

  def reconnecting_adds(self, served, first_id, rows, chunks, log_path):
    """Adds `chunks` acknowledged chunks, opening a new writer whenever the
    learner was lost (ServiceClosed), logging as `logged_adds`."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    index, reconnects = 0, 0
    writer = served.writer(timeout=CALL)
    try:
      while index < chunks:
        os.write(log, f"send {index}\n".encode())
        try:
          writer.add(chunk(first_id + index * rows, rows), policy_version=index, timeout=CALL)
        except jaxbuf.ServiceClosed:
          reconnects += 1
          writer = served.writer(timeout=CALL)  # waits for the restarted learner
          continue
        os.write(log, f"ack {index}\n".encode())
        index += 1
        time.sleep(0.01)
    finally:
      os.close(log)
    return reconnects

  def pickled_writer(self, served):
    writer = served.writer(timeout=CALL)
    result = outcome(ray.put, writer)
    writer.close()
    return result

  def from_two_threads(self, served):
    writer = served.writer(timeout=CALL)
    writer.add(chunk(0, 1), timeout=CALL)
    results = []
    thread = threading.Thread(target=lambda: results.append(outcome(writer.add, chunk(1, 1))))
    thread.start()
    thread.join(CALL)
    writer.close()
    return results[0]
