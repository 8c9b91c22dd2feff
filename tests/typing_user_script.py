"""A user's script that must type-check against jaxbuf with no ignore.

tests/test_typing.py runs mypy on it (and runs it); `assert_type` states the
types an editor shows for each call. Not collected as a test (no `test_`).
"""

from typing import assert_type

import jax
import jax.numpy as jnp
import numpy as np

import jaxbuf


def item_replay() -> None:
  """Prioritized replay, switched from uniform by its one line."""
  buffer = jaxbuf.prioritized_replay(64, alpha=0.6, beta=0.4)
  example = {"obs": jnp.zeros(3, jnp.float32), "reward": jnp.float32(0.0)}
  state = buffer.init(example)
  assert_type(state, jaxbuf.PrioritizedReplayState)
  state = buffer.add(state, {"obs": np.ones((8, 3), np.float32), "reward": np.ones(8, np.float32)})
  size: jax.Array = state.size
  assert int(size) == 8  # read now: the next call consumes (donates) state
  ok = buffer.can_sample(state, 4)
  assert_type(ok, jax.Array)
  assert bool(ok)
  sample = buffer.sample(state, jax.random.key(0), 4, step=1)
  assert_type(sample, jaxbuf.ReplaySample)
  weights: jax.Array = sample.weights
  td_errors = np.abs(np.asarray(sample.items["reward"]))
  state = buffer.update_priorities(state, sample.indices, td_errors, sample.item_ids)
  state = buffer.clear(state)
  assert weights.shape == (4,)


def uniform_then_any_kind(buffer: jaxbuf.Buffer[jaxbuf.ReplayState, jaxbuf.ReplaySample]) -> int:
  """A function written once for any item buffer."""
  state = buffer.init({"obs": jnp.zeros(2, jnp.float32)})
  state = buffer.add(state, {"obs": jnp.ones((4, 2), jnp.float32)})
  return int(state.size)


def sequence_replay() -> None:
  """Windows of steps, with the mask of each first episode."""
  buffer = jaxbuf.sequence_replay(num_envs=2, capacity=16, sequence_length=3)
  state = buffer.init({"obs": jnp.zeros(4, jnp.float32), "last": jnp.bool_(False)})
  for _ in range(4):
    state = buffer.add(state, {"obs": jnp.ones((2, 4), jnp.float32), "last": jnp.zeros(2, bool)})
  sample = buffer.sample(state, jax.random.key(1), 5)
  assert_type(sample, jaxbuf.SequenceSample)
  mask: jax.Array = sample.mask
  assert mask.shape == (5, 3)


def on_policy() -> None:
  """A rollout and its advantages."""
  rollout = jaxbuf.rollout_buffer(num_steps=3, num_envs=2)
  state = rollout.init({"reward": jnp.float32(0.0)})
  state = rollout.add(state, {"reward": jnp.ones(2, jnp.float32)}, mask=[True, False])
  assert_type(state, jaxbuf.RolloutState)
  rewards, values = jnp.ones((3, 2), jnp.float32), jnp.zeros((3, 2), jnp.float32)
  terminated, last_value = jnp.zeros((3, 2), bool), jnp.zeros(2, jnp.float32)
  advantages, returns = jaxbuf.compute_gae(
    rewards, values, terminated, last_value, gamma=0.99, gae_lambda=0.95
  )
  assert advantages.shape == returns.shape == (3, 2)


def main() -> None:
  item_replay()
  assert uniform_then_any_kind(jaxbuf.uniform_replay(8)) == 4
  sequence_replay()
  on_policy()


if __name__ == "__main__":
  main()
