"""What a prioritized step costs on top of a uniform one, piece by piece.

The analysis behind "The floor of a prioritized sample" in RESULTS.md
(bench_replay_fused.py is the benchmark; this only explains it). Each piece
runs K = 200 times in one jitted scan over a 1M-leaf tree or a full 1M-item
buffer (obs [84] float32, add 128, sample 256); microseconds per iteration,
the minimum of 25 repeats. Pin it to one core to take XLA:CPU's thread
hand-offs out: `taskset -c 0 python benchmarks/floors/probe_prioritized_floor.py`.
"""

import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf
from jaxbuf._src.core import random, sum_tree

CAPACITY, ADD_BATCH, SAMPLE_BATCH, OBS_SIZE = 1_000_000, 128, 256, 84
ITERATIONS, REPEATS = 200, 25


def minimum_us(loop, carry) -> tuple[float, object]:
  """Microseconds per iteration of `loop(carry, key) -> carry`, donated."""
  run = jax.jit(loop, donate_argnums=0)
  carry = jax.block_until_ready(run(carry, jax.random.key(0)))
  best = float("inf")
  for repeat in range(REPEATS):
    start = time.perf_counter()
    carry = jax.block_until_ready(run(carry, jax.random.key(repeat)))
    best = min(best, time.perf_counter() - start)
  return best / ITERATIONS * 1e6, carry


def scanned(body):
  """`(carry, key) -> carry`: `body(carry, key)` K times."""

  def loop(carry, key):
    return jax.lax.scan(lambda c, k: (body(c, k), None), carry, jax.random.split(key, ITERATIONS))[
      0
    ]

  return loop


def tree_pieces(tree: sum_tree.SumTree) -> dict:
  """Descent pieces, each summed into a float32 carry."""
  levels = len(tree.levels)

  def bits(acc, key):
    return acc + random.random_bits(key, (4, SAMPLE_BATCH)).sum().astype(jnp.float32)

  def targets(acc, key):
    found, redraws = sum_tree.draw_targets(
      key, SAMPLE_BATCH, sum_tree.total(tree), sum_tree.num_redraws(tree), stratified=True
    )
    return acc + found.sum() + redraws.sum()

  def bare_chain(acc, key):
    # Each row picks the next node from its random bits: the dependent
    # gathers of a descent with none of its arithmetic.
    choice = random.random_bits(key, (SAMPLE_BATCH,))
    node = jnp.zeros(SAMPLE_BATCH, jnp.int32)
    for depth, level in enumerate(reversed(tree.levels[:-1])):
      rows = level.reshape(-1, sum_tree.BRANCHING).at[node].get(mode="promise_in_bounds")
      child = ((choice >> (3 * depth)) & 7).astype(jnp.int32)
      node = node * sum_tree.BRANCHING + jnp.where(rows[:, 0] >= 0, child, 0)
    return acc + node.sum().astype(jnp.float32)

  def descent(acc, key):
    found, values = sum_tree.sample_leaves(tree, key, SAMPLE_BATCH, stratified=True)
    return acc + found.sum().astype(jnp.float32) + values.sum()

  return {
    "random bits [4, S]": bits,
    "targets: bits + strata order (the sort)": targets,
    f"bare chain of {levels - 1} dependent row gathers": bare_chain,
    "sample_leaves, stratified (the whole descent)": descent,
  }


def buffer_pieces(obs: jax.Array) -> dict:
  """Fused steps on a full buffer, the carry `(state, checksum)`."""
  add = functools.partial(jaxbuf.prioritized.add, alpha=0.6)
  sample = functools.partial(jaxbuf.prioritized.sample, beta=0.4)
  update = functools.partial(jaxbuf.prioritized.update_priorities, alpha=0.6, eps=1e-6)

  def uniform_step(carry, key):
    state, acc = carry
    state = jaxbuf.uniform.add(state, {"obs": obs})
    batch = jaxbuf.uniform.sample(state, key, SAMPLE_BATCH)
    return state, acc + batch.items["obs"].sum()

  def prioritized_step(with_update):
    def step(carry, key):
      state, acc = carry
      state = add(state, {"obs": obs})
      batch = sample(state, key, SAMPLE_BATCH)
      acc = acc + batch.items["obs"].sum() + batch.weights.sum()
      if with_update:
        state = update(
          state, batch.indices, jnp.abs(batch.items["obs"][:, 0]) + 0.01, batch.item_ids
        )
      return state, acc

    return step

  return {
    "uniform add + sample": ("uniform", uniform_step),
    "prioritized add + sample": ("prioritized", prioritized_step(False)),
    "prioritized add + sample + update": ("prioritized", prioritized_step(True)),
  }


def main() -> None:
  harness.print_machine()
  leaves = np.random.default_rng(0).random(CAPACITY, np.float32)
  tree = sum_tree.from_leaves(jnp.asarray(leaves))
  for name, body in tree_pieces(tree).items():
    seconds, _ = minimum_us(scanned(body), jnp.zeros((), jnp.float32))
    print(f"{name:50s} {seconds:7.1f} us", flush=True)
  obs = jax.random.normal(jax.random.key(1), (ADD_BATCH, OBS_SIZE))
  items = {
    "obs": jnp.asarray(np.random.default_rng(0).standard_normal((CAPACITY, OBS_SIZE), np.float32))
  }
  buffers = {
    "uniform": jaxbuf.uniform_replay(CAPACITY),
    "prioritized": jaxbuf.prioritized_replay(CAPACITY),
  }
  states = {
    kind: jax.jit(buffer.add, donate_argnums=0)(buffer.init({"obs": jnp.zeros(OBS_SIZE)}), items)
    for kind, buffer in buffers.items()
  }
  del items
  for name, (kind, body) in buffer_pieces(obs).items():
    seconds, (states[kind], _) = minimum_us(
      scanned(body), (states[kind], jnp.zeros((), jnp.float32))
    )
    print(f"{name:50s} {seconds:7.1f} us", flush=True)


if __name__ == "__main__":
  main()
