"""Mistakes a type checker must flag before anything runs.

tests/test_typing.py runs mypy on this file and expects exactly the errors
marked `# error: [<error code>]` on their lines. Never run, and not
collected as a test (no `test_`); the calls are inside a function that
nothing calls.
"""

import jax
import jax.numpy as jnp

import jaxbuf


def mistakes() -> None:
  key = jax.random.key(0)
  buffer = jaxbuf.uniform_replay(64)
  state = buffer.init({"obs": jnp.zeros(3)})
  buffer.sample(state, key)  # error: [call-arg]
  buffer.can_sample(state)  # error: [call-arg]
  buffer.sample(state, key, 2.5)  # error: [arg-type]
  sample = buffer.sample(state, key, 8)
  label: str = sample.weights  # error: [assignment]
  _ = sample.mask  # error: [attr-defined]
  buffer.add(state, {"obs": jnp.ones((2, 3))}, episode_ends=None)  # error: [call-arg]
  buffer.update_priorities(state, sample.indices)  # error: [call-arg]
  streams = jaxbuf.sequence_replay(num_envs=2, capacity=8, sequence_length=2)
  stream_state = streams.init({"obs": jnp.zeros(3)})
  buffer.add(stream_state, {"obs": jnp.ones((2, 3))})  # error: [arg-type]
  windows = streams.sample(stream_state, key, 4)
  mask: int = windows.mask  # error: [assignment]
  rollout = jaxbuf.rollout_buffer(num_steps=4, num_envs=2)
  rollout.add(stream_state, {"obs": jnp.ones((2, 3))})  # error: [arg-type]
  del label, mask
