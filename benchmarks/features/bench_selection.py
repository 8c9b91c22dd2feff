"""Selection and eviction rules (issue 42) against uniform replay, fused.

Shape key: B add batch (128), S sample size (256), C capacity, K iterations.

One iteration adds B items and draws S rows, in one jitted, donated
`lax.scan` of K iterations (`harness.make_fused_loop`), the buffers
interleaved; the carry sums every row drawn. Each rule as a user runs it:

* uniform: add + sample (the baseline); prioritized: add + sample + update.
* uniform / prioritized with `max_times_sampled=4`: add + take (+ update).
* queue: add + take (FIFO).
* heap: add with priorities + sample of the S largest + update.
* keep_best: add with values (evicting the lowest) + sample.

Buffers start full (C items; a queue C - B, so that it never drops).

Usage:
  python benchmarks/features/bench_selection.py            # C = 1M
  python benchmarks/features/bench_selection.py --quick    # C = 10k, seconds
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness  # noqa: E402
import jaxbuf  # noqa: E402

ADD_BATCH, SAMPLE, OBS = 128, 256, 16


def item_batch(count: int, step) -> dict:
  obs = jnp.broadcast_to(jnp.arange(count, dtype=jnp.float32)[:, None], (count, OBS)) + step
  return {"obs": obs, "reward": obs[:, 0] % 7.0}


def bodies(capacity: int) -> dict:
  """name -> (buffer, body(state, key, items, acc) -> (state, acc), fill count)."""

  def sampled(buffer, update=False):
    def body(state, key, items, acc):
      state = buffer.add(state, items)
      batch = buffer.sample(state, key, SAMPLE)
      if update:
        state = buffer.update_priorities(
          state, batch.indices, batch.items["reward"] + 1.0, batch.item_ids
        )
      return state, acc + jnp.sum(batch.items["obs"] * batch.weights[:, None])

    return body

  def taken(buffer, update=False):
    def body(state, key, items, acc):
      state = buffer.add(state, items)
      state, batch = buffer.take(state, key, SAMPLE)
      if update:
        state = buffer.update_priorities(
          state, batch.indices, batch.items["reward"] + 1.0, batch.item_ids
        )
      return state, acc + jnp.sum(batch.items["obs"] * batch.weights[:, None])

    return body

  heap = jaxbuf.heap_replay(capacity)
  keep = jaxbuf.keep_best_replay(capacity)

  def heap_body(state, key, items, acc):
    state = heap.add(state, items, priorities=items["reward"])
    batch = heap.sample(state, key, SAMPLE)
    state = heap.update_priorities(state, batch.indices, -batch.items["reward"], batch.item_ids)
    return state, acc + jnp.sum(batch.items["obs"] * batch.weights[:, None])

  def keep_body(state, key, items, acc):
    state = keep.add(state, items, items["reward"])
    batch = keep.sample(state, key, SAMPLE)
    return state, acc + jnp.sum(batch.items["obs"] * batch.weights[:, None])

  uniform = jaxbuf.uniform_replay(capacity)
  prioritized = jaxbuf.prioritized_replay(capacity)
  uniform4 = jaxbuf.uniform_replay(capacity, max_times_sampled=4)
  prioritized4 = jaxbuf.prioritized_replay(capacity, max_times_sampled=4)
  queue = jaxbuf.queue_replay(capacity)
  return {
    "uniform": (uniform, sampled(uniform), capacity),
    "prioritized": (prioritized, sampled(prioritized, True), capacity),
    "uniform max_times_sampled=4": (uniform4, taken(uniform4), capacity),
    "prioritized max_times_sampled=4": (prioritized4, taken(prioritized4, True), capacity),
    "queue (fifo)": (queue, taken(queue), capacity - ADD_BATCH),
    "heap (max)": (heap, heap_body, capacity),
    "keep_best": (keep, keep_body, capacity),
  }


def filled(name: str, buffer, count: int):
  state = buffer.init(jax.tree.map(lambda x: x[0], item_batch(1, 0.0)))
  items = item_batch(count, 0.0)
  if name == "keep_best":
    return buffer.add(state, items, items["reward"])
  if name.startswith("heap"):
    return buffer.add(state, items, priorities=items["reward"])
  return buffer.add(state, items)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--capacity", type=int, default=None)
  parser.add_argument("--iterations", type=int, default=50)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  capacity = args.capacity or (10_000 if args.quick else 1_000_000)
  iterations = 10 if args.quick else args.iterations
  harness.print_machine(("jax", "jaxlib", "numpy", "flax"))
  made = bodies(capacity)
  loops, states = {}, {}
  for name, (buffer, body, count) in made.items():
    print(f"C={capacity} {name}: filling", flush=True)
    states[name] = filled(name, buffer, count)
    loops[name] = harness.make_fused_loop(
      body, iterations, lambda step: item_batch(ADD_BATCH, step)
    )
  seconds = harness.time_fused_loops(
    loops, states, iterations=iterations, repeats=2 if args.quick else args.repeats
  )
  base = seconds["uniform"]
  print(f"\nC={capacity}, B={ADD_BATCH}, S={SAMPLE}, K={iterations} per fused call")
  harness.print_table(
    [("rule", 34), ("us / iteration", 16), ("x uniform", 10)],
    [
      (name, harness.microseconds(value), harness.ratio_text(harness.ratio(value, base)))
      for name, value in seconds.items()
    ],
  )
  harness.print_load_average_after()


if __name__ == "__main__":
  main()
