"""The stream kinds' samples against their own floors (issue 36).

Each kind built on the per-env rings of sequence replay is timed sampling
alone, against a floor that reads the same bytes as contiguous slices from
bare `[N, R, ...]` arrays (no library, no validity, no episodes): S draws
in one jitted scan of K samples, everything sampled summed so nothing is
dead code, interleaved, microseconds per sample, median of the repeats.

* frame-stack (`frame_stack_replay`, 8 envs, 84x84 uint8 frames, stacks of
  4, n_step 3, S = 32): a transition reads the K + n frames from its stack's
  oldest to its next stack's newest, and n + 1 rows of action, reward and
  terminated. Floor: one `dynamic_slice` of K + n frames and one of n + 1
  rows of each other leaf per transition, vmapped; the stacks cut from the
  frames and moved to the last axis, as jaxbuf's are.
* hindsight (`hindsight_replay`, 16 envs, FetchReach-shaped steps, episodes
  of 50, S = 256): a transition reads its step and the next one, and one
  step's achieved goal for the new goal. Floor: one slice of 2 rows of
  every leaf and one of 1 row of the achieved goal, vmapped.
* episode (`episode_replay`, 128 envs, the sequence step of
  `sequence_adapters.py`, episodes of 20-40 steps, M = 40, S = 64): an
  episode reads M rows. Floor: one slice of M rows per episode, vmapped
  (`floor_slices` of bench_sequence with L = M).

Usage: python benchmarks/floors/probe_stream_floors.py [--kinds frames hindsight
episode] [--repeats 15]
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf
from benchmarks.common import sequence_adapters

DRAWS = 50


def checksum(tree) -> jax.Array:
  return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def timed_samples(sample, state):
  """A thunk: `DRAWS` samples of `state` in one jitted scan."""

  def run(state, key):
    def draw(acc, draw_key):
      return acc + checksum(sample(state, draw_key)), None

    return jax.lax.scan(draw, jnp.float32(0), jax.random.split(key, DRAWS))[0]

  compiled = jax.jit(run)
  return lambda: compiled(state, jax.random.key(0))


def slices(storage, envs, starts, length):
  """`[S, length, ...]`: one contiguous `dynamic_slice` per (env, start)."""

  def cut(column):
    tail = column.shape[2:]
    return jax.vmap(
      lambda env, start: jax.lax.dynamic_slice(
        column, (env, start) + (0,) * len(tail), (1, length) + tail
      )[0]
    )(envs, starts)

  return jax.tree.map(cut, storage)


def random_starts(key, num_envs, num_starts, batch):
  env_key, start_key = jax.random.split(key)
  return (
    jax.random.randint(env_key, (batch,), 0, num_envs),
    jax.random.randint(start_key, (batch,), 0, num_starts),
  )


def bare(state):
  """The floor's arrays: the buffer's own storage, unpadded `[N, R, ...]`."""
  per_env = state.episode_ends.shape[1]
  return jax.tree.map(lambda leaf: leaf[:, :per_env], state.storage)


def filled(buffer, state, per_env, chunk, end_rate, observations):
  """`state` with `per_env` steps per env added in chunks, episodes ending
  at `end_rate`; `observations(rng, (N, chunk))` makes the obs."""
  add = jax.jit(buffer.add, donate_argnums=0)
  rng = np.random.default_rng(0)
  num_envs = state.episode_ends.shape[0]
  for _ in range(per_env // chunk):
    steps = {
      "obs": observations(rng, (num_envs, chunk)),
      "action": np.zeros((num_envs, chunk), np.int32),
      "reward": np.ones((num_envs, chunk), np.float32),
      "terminated": np.zeros((num_envs, chunk), bool),
    }
    ends = rng.random((num_envs, chunk)) < end_rate
    state = add(state, steps, episode_end=ends)
  return state


# ---------------------------------------------------------------- kinds


def frames_case():
  num_envs, capacity, stack, n_step, batch = 8, 80_000, 4, 3, 32
  buffer = jaxbuf.frame_stack_replay(num_envs, capacity, stack, n_step=n_step)
  per_env = capacity // num_envs
  state = buffer.init(
    {
      "obs": jnp.zeros((84, 84), jnp.uint8),
      "action": jnp.int32(0),
      "reward": jnp.float32(0),
      "terminated": jnp.bool_(False),
    }
  )
  state = filled(
    buffer,
    state,
    per_env,
    1000,
    1 / 500,
    lambda rng, shape: rng.integers(0, 255, shape + (84, 84), np.uint8),
  )

  def floor(storage, key):
    envs, starts = random_starts(key, num_envs, per_env - stack - n_step, batch)
    frames = slices(storage["obs"], envs, starts, stack + n_step)
    rows = slices(
      {name: storage[name] for name in ("action", "reward", "terminated")},
      envs,
      starts + stack - 1,
      n_step + 1,
    )
    return (jnp.moveaxis(frames[:, :stack], 1, -1), jnp.moveaxis(frames[:, n_step:], 1, -1), rows)

  return {
    "jaxbuf frame_stack_replay": timed_samples(
      lambda s, k: buffer.sample(s, k, batch).items, state
    ),
    "floor (contiguous slices)": timed_samples(floor, bare(state)),
  }


def hindsight_case():
  num_envs, capacity, batch, episode = 16, 1_000_000, 256, 50
  reward_fn = lambda achieved, desired: (
    -(jnp.linalg.norm(achieved - desired, axis=-1) > 0.05).astype(jnp.float32)
  )
  buffer = jaxbuf.hindsight_replay(num_envs, capacity, reward_fn)
  per_env = capacity // num_envs
  rng = np.random.default_rng(0)
  vector = lambda size: rng.standard_normal((num_envs, per_env, size), np.float32)
  steps = {
    "obs": {"observation": vector(10), "achieved_goal": vector(3), "desired_goal": vector(3)},
    "action": vector(4),
    "reward": np.zeros((num_envs, per_env), np.float32),
    "terminated": np.zeros((num_envs, per_env), bool),
  }
  ends = (np.arange(per_env) % (episode + 1) == episode)[None].repeat(num_envs, 0)
  state = buffer.init(jax.tree.map(lambda x: x[0, 0], steps))
  state = buffer.add(state, steps, episode_end=ends)

  def floor(storage, key):
    step_key, goal_key = jax.random.split(key)
    envs, starts = random_starts(step_key, num_envs, per_env - 1, batch)
    pairs = slices(storage, envs, starts, 2)
    goals = slices(
      storage["obs"]["achieved_goal"],
      envs,
      jnp.minimum(starts + jax.random.randint(goal_key, (batch,), 1, episode), per_env - 1),
      1,
    )
    return pairs, goals

  return {
    "jaxbuf hindsight_replay": timed_samples(lambda s, k: buffer.sample(s, k, batch).items, state),
    "floor (contiguous slices)": timed_samples(floor, bare(state)),
  }


def episode_case():
  num_envs, per_env = sequence_adapters.NUM_ENVS, 7840
  length, batch = 40, sequence_adapters.SAMPLE_BATCH
  buffer = jaxbuf.episode_replay(num_envs, num_envs * per_env, length)
  state = buffer.init(sequence_adapters.example_step())
  state = filled(
    buffer,
    state,
    per_env,
    980,
    1 / 30,
    lambda rng, shape: rng.normal(size=shape + (84,)).astype(np.float32),
  )

  def floor(storage, key):
    envs, starts = random_starts(key, num_envs, per_env - length + 1, batch)
    return slices(storage, envs, starts, length)

  return {
    "jaxbuf episode_replay": timed_samples(lambda s, k: buffer.sample(s, k, batch).items, state),
    "floor (contiguous slices)": timed_samples(floor, bare(state)),
  }


CASES = {"frames": frames_case, "hindsight": hindsight_case, "episode": episode_case}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kinds", nargs="+", choices=sorted(CASES), default=list(CASES))
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  harness.print_machine(("jax", "jaxlib", "numpy"))
  for name in args.kinds:
    calls = CASES[name]()
    seconds = harness.time_interleaved(calls, repeats=args.repeats, warmup=2)
    jaxbuf_name, floor_name = calls
    print(
      f"{name}: "
      + ", ".join(f"{label} {value / DRAWS * 1e6:.1f} us" for label, value in seconds.items())
      + f"; jaxbuf / floor "
      f"{seconds[jaxbuf_name] / seconds[floor_name]:.2f}x",
      flush=True,
    )
    del calls
  harness.print_load_average_after()


if __name__ == "__main__":
  main()
