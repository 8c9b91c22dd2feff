"""Loading (and writing) a Minari dataset of 1M transitions: speed and memory.

The dataset is the issue's case, MuJoCo-sized: 1000 episodes of 1000 steps,
observations of 17 float32 (HalfCheetah's), actions of 6 float32, float32
rewards, every episode truncated at its time limit; written once with Minari
(HDF5) under a scratch MINARI_DATASETS_PATH.

Each measurement runs in a fresh process (`harness.run_child`), so nothing
earlier hides its peak: `jaxbuf.from_minari` into a uniform replay buffer of
1M `Transition`s (items) and into a sequence replay buffer of one env
(streams: 1M + 1000 steps), then `jaxbuf.to_minari` of the loaded items.
The peak is the process's resident set (VmHWM, reset before the work),
against a baseline taken after JAX has started and a tiny load compiled the
runtime; "added / buffer" divides the peak added by the buffer's own bytes.
The target (issue 22) is peak <= 1.3x the buffer + the dataset's own
memory: no second full copy. Minari reads one episode at a time, mapping
nothing, but h5py's caches grow while a file stays open; a third child
measures that alone (reading every episode as from_minari does, no buffer),
and the verdict subtracts it. Times include the compilation of the adds.

Run: python benchmarks/features/bench_offline.py [--episodes 1000] [--length 1000]
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness

OBS_SIZE, ACTION_SIZE = 17, 6


def write_dataset(dataset_id: str, episodes: int, length: int) -> None:
  import gymnasium  # pylint: disable=import-outside-toplevel
  import minari  # pylint: disable=import-outside-toplevel
  from minari.data_collector import EpisodeBuffer  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)

  def episode():
    return EpisodeBuffer(
      observations=rng.standard_normal((length + 1, OBS_SIZE), np.float32),
      actions=rng.uniform(-1, 1, (length, ACTION_SIZE)).astype(np.float32),
      rewards=rng.standard_normal(length, np.float32),
      terminations=np.zeros(length, bool),
      truncations=np.arange(length) == length - 1,
    )

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    minari.create_dataset_from_buffers(
      dataset_id,
      (episode() for _ in range(episodes)),
      observation_space=gymnasium.spaces.Box(-np.inf, np.inf, (OBS_SIZE,), np.float32),
      action_space=gymnasium.spaces.Box(-1, 1, (ACTION_SIZE,), np.float32),
    )


def child(kind: str, dataset_id: str) -> dict:
  """One measurement in this fresh process; the result as a dict."""
  import jax  # pylint: disable=import-outside-toplevel
  import minari  # pylint: disable=import-outside-toplevel
  import jaxbuf  # pylint: disable=import-outside-toplevel

  dataset = minari.load_dataset(dataset_id)
  steps, episodes = dataset.total_steps, dataset.total_episodes
  if kind == "read":
    # The dataset's own cost: Minari (h5py) reading every episode once, as
    # from_minari does (its reader: the file reopened every few episodes),
    # with no buffer.
    from jaxbuf._src.offline import minari_datasets  # pylint: disable=import-outside-toplevel

    memory = harness.PeakMemory(host=True).start()
    start = time.perf_counter()
    for _ in minari_datasets.episode_reader(dataset)(range(episodes)):
      pass
    return dict(
      kind=kind,
      transitions=steps,
      read_seconds=time.perf_counter() - start,
      added_bytes=memory.stop().added,
    )

  def make_buffer(capacity):
    if kind == "sequence":
      return jaxbuf.sequence_replay(1, capacity, sequence_length=2)
    return jaxbuf.uniform_replay(capacity)

  # Start the runtime (a buffer that holds the newest episode only) before
  # the baseline.
  tiny = make_buffer(dataset[0].rewards.shape[0] + 1)
  jax.block_until_ready(
    jaxbuf.from_minari(dataset, tiny, tiny.init(jaxbuf.offline_example(dataset, tiny)))
  )
  buffer = make_buffer(steps + (episodes if kind == "sequence" else 0))
  memory = harness.PeakMemory(host=True).start()
  start = time.perf_counter()
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  state = jaxbuf.from_minari(dataset, buffer, state)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  memory.stop()
  buffer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  result = dict(
    kind=kind,
    transitions=steps,
    load_seconds=seconds,
    buffer_bytes=buffer_bytes,
    added_bytes=memory.added,
    peak_was_reset=memory.peak_was_reset,
  )
  if kind == "uniform":
    memory = harness.PeakMemory(host=True).start()
    start = time.perf_counter()
    jaxbuf.to_minari(
      dataset_id.replace("-v0", "-back-v0"),
      buffer,
      state,
      observation_space=dataset.observation_space,
      action_space=dataset.action_space,
      reward_dtype=np.float32,
    )
    result.update(write_seconds=time.perf_counter() - start, write_added_bytes=memory.stop().added)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--episodes", type=int, default=1000)
  parser.add_argument("--length", type=int, default=1000)
  parser.add_argument("--child", nargs=2, default=None)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(*args.child)))
    return
  harness.print_machine(harness.PACKAGES + ("minari", "h5py"))
  with tempfile.TemporaryDirectory() as scratch:
    os.environ["MINARI_DATASETS_PATH"] = scratch
    dataset_id = f"bench/halfcheetah-like/e{args.episodes}-l{args.length}-v0"
    start = time.perf_counter()
    write_dataset(dataset_id, args.episodes, args.length)
    print(f"dataset written by Minari in {time.perf_counter() - start:.1f} s", flush=True)
    read, *results = [
      harness.run_child(__file__, ["--child", kind, dataset_id])
      for kind in ("read", "uniform", "sequence")
    ]
  rows, verdicts = [], harness.Verdicts()
  if "error" in read:
    print(f"error: {read['error']}")
    return
  verdicts.info(
    f"Minari reading the {read['transitions']:,} transitions alone (no "
    f"buffer): {read['read_seconds']:.2f} s, peak RSS added "
    f"{read['added_bytes'] / 2**20:.0f} MiB (h5py's caches: the "
    "dataset's own memory)"
  )
  for result in results:
    if "error" in result:
      print(f"error: {result['error']}")
      continue
    ratio = result["added_bytes"] / result["buffer_bytes"]
    verdicts.judge(
      f"{result['kind']}: (peak RSS added - Minari's own) / buffer bytes",
      (result["added_bytes"] - read["added_bytes"]) / result["buffer_bytes"],
      1.3,
      higher_is_better=False,
    )
    rows.append(
      (
        result["kind"],
        f"{result['transitions']:,}",
        f"{result['load_seconds']:.2f}",
        f"{result['transitions'] / result['load_seconds'] / 1e6:.2f}",
        f"{result['buffer_bytes'] / 2**20:.0f}",
        f"{result['added_bytes'] / 2**20:.0f}",
        f"{ratio:.2f}",
      )
    )
    if "write_seconds" in result:
      verdicts.info(
        f"to_minari of the {result['transitions']:,} items: "
        f"{result['write_seconds']:.2f} s "
        f"({result['transitions'] / result['write_seconds'] / 1e6:.2f} M "
        f"transitions/s), peak RSS added "
        f"{result['write_added_bytes'] / 2**20:.0f} MiB"
      )
  harness.print_table(
    [
      ("buffer", -9),
      ("transitions", 12),
      ("load s", 7),
      ("M/s", 6),
      ("buffer MiB", 11),
      ("added MiB", 10),
      ("added/buffer", 13),
    ],
    rows,
  )
  verdicts.print("verdicts")


if __name__ == "__main__":
  sys.exit(main())
