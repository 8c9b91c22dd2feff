"""Checkpoint save/load time and bytes: jaxbuf.save/load (orbax) against numpy.

The state is the issue's case: a prioritized buffer of 1M items, each an (84,)
float32 observation, full, with priorities set. The NumPy baseline writes the
same arrays (every leaf of the state) with `numpy.savez`, i.e. `numpy.save`
per array into one uncompressed file, and reads them back with `numpy.load`.

Both sides write through the OS page cache and read back warm; neither number
includes the time to reach the disk platter. `jaxbuf.save` additionally pays
for atomicity (a temporary directory, renames, directory fsyncs) and for the
layout check on load, and since issue 12 for a CRC-32 of every array at save,
verified at load. Each measurement is the median of `--repeats` runs.

`--baseline FILE` also times the `save`/`load` of another checkpoint module
(e.g. the previous version: `git show HEAD~1:jaxbuf/_src/checkpoint/saving.py >
/tmp/old_checkpoint.py`), rounds interleaved with the current one in the same
process, and prints current / baseline ratios. The file is loaded alone and
takes the rest of jaxbuf from the current tree, so it must hold the whole of
`save`/`load`: a `checkpoint.py` from before its split into `checkpoint_*.py`
rooms (bec42e4 and earlier) does; for a later version, run this script once
per tree (`PYTHONPATH=<tree>`) instead.

Run: .venv/bin/python benchmarks/features/bench_checkpoint.py [--capacity N] [--repeats R]
       [--baseline FILE]
"""

import argparse
import importlib.util
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf


def directory_bytes(path: pathlib.Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_state(capacity: int) -> jaxbuf.PrioritizedReplayState:
  buffer = jaxbuf.prioritized_replay(capacity)
  state = buffer.init(jnp.zeros(84, jnp.float32))
  observations = np.random.default_rng(0).standard_normal((capacity, 84), np.float32)
  state = buffer.add(state, jnp.asarray(observations))
  batch = 4096
  for start in range(0, capacity, batch * 16):
    indices = jnp.arange(start, min(start + batch, capacity), dtype=jnp.int32)
    state = buffer.update_priorities(
      state, indices, jax.random.uniform(jax.random.key(start), indices.shape) * 10
    )
  return jax.block_until_ready(state)


def timed(function, repeats: int) -> tuple[float, object]:
  times, result = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = function()
    times.append(time.perf_counter() - start)
  return statistics.median(times), result


def load_module(file: str):
  spec = importlib.util.spec_from_file_location("baseline_checkpoint", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def bit_exact(restored, state) -> bool:
  return all(
    np.array_equal(
      np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    )
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state))
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--capacity", type=int, default=1_000_000)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--baseline", default=None, help="a checkpoint module file to compare with")
  args = parser.parse_args()

  state = make_state(args.capacity)
  leaves = {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
  }
  array_bytes = sum(leaf.nbytes for leaf in leaves.values())
  like = jax.eval_shape(lambda: state)
  libraries = {"jaxbuf": (jaxbuf.save, jaxbuf.load)}
  if args.baseline:
    baseline = load_module(args.baseline)
    libraries["baseline"] = (baseline.save, baseline.load)
  times = {name: {"save": [], "overwrite": [], "load": []} for name in libraries}
  exact, on_disk = {}, {}
  work = pathlib.Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
  try:
    for repeat in range(args.repeats):
      for name, (save, load) in libraries.items():
        fresh = work / f"{name}_{repeat}"
        for phase, call in (
          ("save", lambda: save(fresh, state)),
          ("overwrite", lambda: save(work / f"{name}_0", state)),
          ("load", lambda: jax.block_until_ready(load(work / f"{name}_0", like=like))),
        ):
          seconds, result = timed(call, 1)
          times[name][phase].append(seconds)
        exact[name] = bit_exact(result, state)
        on_disk[name] = directory_bytes(work / f"{name}_0")

    npz = work / "numpy_arrays.npz"

    def numpy_save():
      np.savez(npz, **{f"leaf{i}": leaf for i, leaf in enumerate(leaves.values())})

    def numpy_load():
      with np.load(npz) as data:
        return [data[name] for name in data.files]

    numpy_save_seconds, _ = timed(numpy_save, args.repeats)
    numpy_load_seconds, _ = timed(numpy_load, args.repeats)
    numpy_bytes = directory_bytes(npz)
  finally:
    shutil.rmtree(work, ignore_errors=True)

  median = {
    name: {phase: statistics.median(values) for phase, values in phases.items()}
    for name, phases in times.items()
  }
  harness.print_machine(("jax", "jaxlib", "orbax-checkpoint", "numpy"))
  print(
    f"state: prioritized replay, capacity {args.capacity}, obs (84,) float32, "
    f"{len(leaves)} arrays, {array_bytes / 1e6:.1f} MB of array data; "
    f"median of {args.repeats}"
  )
  print(f"{'':28s}{'save s':>9s}{'load s':>9s}{'overwrite s':>13s}{'MB on disk':>12s}")
  for name in libraries:
    # Built only for the rows present: without --baseline there is no file name.
    label = (
      "jaxbuf.save/load (orbax)"
      if name == "jaxbuf"
      else f"baseline ({pathlib.Path(args.baseline).name})"
    )
    print(
      f"{label:28s}{median[name]['save']:9.2f}{median[name]['load']:9.2f}"
      f"{median[name]['overwrite']:13.2f}{on_disk[name] / 1e6:12.1f}"
    )
  print(
    f"{'numpy.savez/load':28s}{numpy_save_seconds:9.2f}{numpy_load_seconds:9.2f}"
    f"{'':13s}{numpy_bytes / 1e6:12.1f}"
  )
  ours = median["jaxbuf"]
  print(
    f"jaxbuf / numpy: save {ours['save'] / numpy_save_seconds:.2f}x, "
    f"load {ours['load'] / numpy_load_seconds:.2f}x"
  )
  if "baseline" in median:
    print(
      "jaxbuf / baseline: "
      + ", ".join(
        f"{phase} {ours[phase] / median['baseline'][phase]:.2f}x"
        for phase in ("save", "load", "overwrite")
      )
    )
  print("round trip bit-exact: " + ", ".join(f"{n} {e}" for n, e in exact.items()))


if __name__ == "__main__":
  main()
