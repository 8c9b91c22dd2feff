"""A learner's process for tests/test_ray.py's restart test: it joins the
test's Ray cluster, serves an items service under a name, checkpoints when
told (a file appears), and, restored from that checkpoint, records what it
held at its start and at its end. Killed with SIGKILL by the test.

  python tests/ray_learner.py ADDRESS NAMESPACE NAME FOLDER first|restore
"""

import pathlib
import sys
import time

import numpy as np
import ray

import jaxbuf
import jaxbuf.ray

WAIT = 120.0  # s: the longest this process waits for the test's signal


def wait_for(path: pathlib.Path) -> None:
  deadline = time.monotonic() + WAIT
  while not path.exists():
    if time.monotonic() > deadline:
      raise TimeoutError(f"no {path.name} within {WAIT} s")
    time.sleep(0.05)


def held_ids(service) -> np.ndarray:
  state = service.state
  return np.asarray(state.storage["id"])[: int(state.size)]


def main(address: str, namespace: str, name: str, folder: str, mode: str) -> None:
  folder_path = pathlib.Path(folder)
  ray.init(address=address, namespace=namespace, log_to_driver=False)
  buffer = jaxbuf.uniform_replay(2**14)
  like = buffer.init({"x": np.float32(0), "id": np.int32(0)})
  if mode == "first":
    service = jaxbuf.ReplayService(buffer, like)
  else:
    service = jaxbuf.ReplayService.restore(folder_path / "checkpoint", buffer, like)
    np.save(folder_path / "restored_ids.npy", held_ids(service))
  served = jaxbuf.ray.serve(service, name=name)
  (folder_path / f"{mode}.ready").touch()
  if mode == "first":
    wait_for(folder_path / "checkpoint.now")
    service.checkpoint(folder_path / "checkpoint")
    (folder_path / "checkpoint.done").touch()
    time.sleep(WAIT)  # adds go on until the test kills this process
    return
  wait_for(folder_path / "stop.now")
  np.save(folder_path / "final_ids.npy", held_ids(service))
  np.save(folder_path / "final_counts.npy", np.asarray(service.counts))
  served.close()


if __name__ == "__main__":
  main(*sys.argv[1:])
