"""One of the processes `tests/test_service.py` starts: 2 CPU devices each.

Usage: python tests/service_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

A `ReplayService` in lockstep over one uniform item buffer sharded across
every process's devices: this process's actor thread adds its own rows at
its own pace (process 1 more slowly, in other sizes), the main thread
samples in lockstep until the limiter refuses (a timeout every process
sees at the same round), and what it saw goes to `OUT_DIR/process_<id>.npz`.
"""

import sys
import threading
import time

import numpy as np

ROWS = {0: (40, 5, 0.0), 1: (24, 3, 0.002)}  # rows, rows per add, seconds between adds
BATCH = 8


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_num_cpu_devices", 2)
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=num_processes, process_id=process_id
  )
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  import jaxbuf  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  buffer = jaxbuf.sharded(jaxbuf.uniform_replay(128), mesh, batch="replicated")
  limiter = jaxbuf.SampleToInsertRatio(1.0, min_size=8, error_buffer=16.0)
  service = jaxbuf.ReplayService(
    buffer, buffer.init({"serial": np.int32(0)}), rate_limiter=limiter, lockstep_rows=8
  )
  total, size, pause = ROWS[process_id]

  def actor():
    writer = service.writer()
    for start in range(0, total, size):
      serial = 1000 * process_id + np.arange(start, start + size, dtype=np.int32)
      writer.add({"serial": serial}, timeout=30)
      time.sleep(pause)

  thread = threading.Thread(target=actor)
  thread.start()
  drawn = []
  timed_out = ""
  while True:
    try:
      sample = service.sample(jax.random.key(len(drawn)), BATCH, timeout=1.0)
    except TimeoutError as error:
      timed_out = str(error)
      break
    drawn.append(np.asarray(sample.batch.items["serial"].addressable_data(0)))
  thread.join(30)
  # Adds pending on the host (10 rows here, 3 there: two rounds' worth on
  # process 0), then a checkpoint in both: its rounds take them all.
  late = service.writer()
  for start in range(0, 10 if process_id == 0 else 3, 5):
    count = min(5, (10 if process_id == 0 else 3) - start)
    late.add({"serial": 1000 * process_id + 500 + start + np.arange(count, dtype=np.int32)})
  service.checkpoint(f"{out_dir}/cut")  # one path, as jaxbuf.save asks
  checkpointed = service.counts.inserts
  state = service.state
  storage = multihost_utils.process_allgather(state.storage["serial"], tiled=True)
  size_held = multihost_utils.process_allgather(state.size, tiled=True)
  service.close()
  np.savez(
    f"{out_dir}/process_{process_id}.npz",
    drawn=np.stack(drawn),
    storage=np.asarray(storage),
    size=np.asarray(size_held),
    inserts=service.counts.inserts,
    samples=service.counts.samples,
    timed_out=timed_out,
    checkpointed=checkpointed,
  )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
