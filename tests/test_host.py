"""Calling jaxbuf from a Python loop: NumPy adds, `sample(step=)`, gymnasium.

The NumPy add sends a batch's leaves as one byte array; every test here
compares it with the same batch added as JAX arrays (the reference), so a
packing mistake in any dtype or layout shows as a differing state.
"""

import subprocess
import sys

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from examples import gymnasium_dqn

pytestmark = pytest.mark.usefixtures("x64_mode")

BUFFERS = {
  "uniform": lambda: jaxbuf.uniform_replay(16),
  "prioritized": lambda: jaxbuf.prioritized_replay(16),
}


def example_item():
  return {
    "obs": np.zeros((2, 3), np.float32),
    "action": np.int64(0),
    "done": np.bool_(False),
    "pixel": np.zeros(5, np.uint8),
    "half": np.float16(0),
    "small": np.int8(0),
    "wide": np.float64(0),
  }


def numpy_batch(rng: np.random.Generator, size: int) -> dict:
  return {
    "obs": rng.normal(size=(size, 2, 3)).astype(np.float32),
    "action": rng.integers(-(2**31), 2**31, size),
    "done": rng.random(size) < 0.5,
    "pixel": rng.integers(0, 256, (size, 5)).astype(np.uint8),
    "half": rng.normal(size=size).astype(np.float16),
    "small": rng.integers(-128, 128, size).astype(np.int8),
    "wide": rng.normal(size=size),
  }


def as_jax(batch: dict) -> dict:
  """The reference: each leaf converted by JAX itself, leaf by leaf."""
  return {name: jnp.asarray(leaf) for name, leaf in batch.items()}


def assert_same_state(state, expected):
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", BUFFERS)
def test_numpy_add_matches_jax_array_add(kind):
  buffer = BUFFERS[kind]()
  state, expected = buffer.init(example_item()), buffer.init(example_item())
  rng = np.random.default_rng(0)
  for size in (3, 5, 3, 20):  # wraps around, then more than the capacity
    batch = numpy_batch(rng, size)
    state = buffer.add(state, batch)
    expected = buffer.add(expected, as_jax(batch))
  assert_same_state(state, expected)


def test_numpy_add_of_views_matches():
  """Transposed and strided leaves are packed in their logical order."""
  buffer = jaxbuf.uniform_replay(8)
  example = {"a": np.zeros(3, np.float32), "b": np.int32(0)}
  state, expected = buffer.init(example), buffer.init(example)
  a = np.arange(12, dtype=np.float32).reshape(3, 4).T  # [4, 3]
  b = np.arange(8, dtype=np.int32)[::2]  # [4]
  state = buffer.add(state, {"a": a, "b": b})
  expected = buffer.add(expected, {"a": jnp.asarray(a), "b": jnp.asarray(b)})
  assert_same_state(state, expected)


def test_numpy_add_mixed_with_jax_leaves():
  buffer = jaxbuf.uniform_replay(8)
  example = {"a": np.zeros(3, np.float32), "b": np.int32(0)}
  state = buffer.add(
    buffer.init(example), {"a": jnp.ones((2, 3), jnp.float32), "b": np.array([4, 5], np.int32)}
  )
  np.testing.assert_array_equal(state.storage["b"][:2], [4, 5])


def test_numpy_add_still_refuses_int64_that_would_wrap(x64_mode):
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init({"action": np.int64(0)})
  state = buffer.add(state, {"action": np.array([1, 2**31 - 1])})
  bad = {"action": np.array([1, 2**40])}
  if x64_mode:  # stored as int64: nothing wraps
    state = buffer.add(state, bad)
    assert int(state.storage["action"][2 + 1]) == 2**40
  else:
    with pytest.raises(ValueError, match=r"\['action'\] holds 1099511627776"):
      buffer.add(state, bad)


def test_numpy_add_errors_name_the_leaf():
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init({"obs": np.zeros(4, np.float32), "n": np.int32(0)})
  with pytest.raises(TypeError, match=r"leaf \['n'\] has dtype float32"):
    buffer.add(state, {"obs": np.zeros((2, 4), np.float32), "n": np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match=r"leaf \['obs'\] has shape \(2, 5\)"):
    buffer.add(state, {"obs": np.zeros((2, 5), np.float32), "n": np.zeros(2, np.int32)})
  with pytest.raises(ValueError, match=r"disagree on the batch shape: \['n'\] \(3,\)"):
    buffer.add(state, {"obs": np.zeros((2, 4), np.float32), "n": np.zeros(3, np.int32)})


def test_numpy_add_to_sequence_replay_matches():
  buffer = jaxbuf.sequence_replay(2, 16, 3)
  example = {"obs": np.zeros(2, np.float32), "step": np.int32(0)}
  state, expected = buffer.init(example), buffer.init(example)
  for t in range(5):
    steps = {"obs": np.full((2, 2), t, np.float32), "step": np.full(2, t, np.int32)}
    state = buffer.add(state, steps)
    expected = buffer.add(expected, as_jax(steps))
  assert_same_state(state, expected)


@pytest.mark.parametrize("kind", BUFFERS)
def test_sample_step_folds_the_step_into_the_key(kind):
  buffer = BUFFERS[kind]()
  state = buffer.add(buffer.init(np.float32(0)), np.arange(16, dtype=np.float32))
  for key in (jax.random.key(1), jax.random.PRNGKey(1)):
    for step in (0, 7, 2**31 - 1, jnp.int32(-3), np.uint32(2**32 - 1)):
      got = buffer.sample(state, key, 32, step=step)
      want = buffer.sample(state, jax.random.fold_in(key, step), 32)
      np.testing.assert_array_equal(got.indices, want.indices)
  key = jax.random.key(1)
  assert not np.array_equal(
    buffer.sample(state, key, 32, step=1).indices, buffer.sample(state, key, 32, step=2).indices
  )


def test_sample_step_under_jit_and_vmap():
  buffer = jaxbuf.uniform_replay(16)
  state = buffer.add(buffer.init(np.float32(0)), np.arange(16, dtype=np.float32))
  key = jax.random.key(3)
  steps = jnp.arange(4)
  sample_at = lambda step: buffer.sample(state, key, 8, step=step).indices
  got = jax.jit(jax.vmap(sample_at))(steps)
  for step in range(4):
    np.testing.assert_array_equal(
      got[step], buffer.sample(state, jax.random.fold_in(key, step), 8).indices
    )


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("step", [1.5, True, np.array([1, 2]), "3"])
def test_sample_step_must_be_an_integer_scalar(checked, step):
  buffer = jaxbuf.uniform_replay(16, checked=checked)
  state = buffer.add(buffer.init(np.float32(0)), np.ones(4, np.float32))
  with pytest.raises(TypeError, match="sample: step must be an integer"):
    buffer.sample(state, jax.random.key(0), 4, step=step)


# --- gymnasium spaces --------------------------------------------------------

SPACES = {
  "box": gym.spaces.Box(-1.0, 1.0, (3, 2), np.float32),
  "box_uint8": gym.spaces.Box(0, 255, (4, 4, 1), np.uint8),
  "box_float64": gym.spaces.Box(-1.0, 1.0, (2,), np.float64),
  "discrete": gym.spaces.Discrete(5, start=2),
  "multi_discrete": gym.spaces.MultiDiscrete([3, 4, 2]),
  "multi_binary": gym.spaces.MultiBinary([2, 3]),
  "dict": gym.spaces.Dict(
    {
      "position": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
      "inventory": gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.MultiBinary(4))),
    }
  ),
}


@pytest.mark.parametrize("name", SPACES)
def test_example_from_space_is_shaped_like_the_space_samples(name):
  """The reference is gymnasium's own: `space.sample()`."""
  space = SPACES[name]
  space.seed(0)
  element = space.sample()
  example = jaxbuf.example_from_space(space)
  assert jax.tree.structure(example) == jax.tree.structure(element)
  for got, want in zip(jax.tree.leaves(example), jax.tree.leaves(element), strict=True):
    assert isinstance(got, np.ndarray)
    assert (got.shape, got.dtype) == (np.shape(want), np.asarray(want).dtype)
    assert not got.any()


@pytest.mark.parametrize("name", SPACES)
def test_space_samples_add_and_come_back(name):
  """Stacked samples of the space add from NumPy and sample back unchanged."""
  space = SPACES[name]
  space.seed(1)
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init(jaxbuf.example_from_space(space))
  elements = [space.sample() for _ in range(8)]
  batch = jax.tree.map(lambda *leaves: np.stack(leaves), *elements)
  state = buffer.add(state, batch)
  sample = buffer.sample(state, jax.random.key(0), 16)
  for got, added in zip(jax.tree.leaves(sample.items), jax.tree.leaves(batch), strict=True):
    want = jnp.asarray(added)[np.asarray(sample.indices)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_example_from_space_refuses_spaces_without_a_fixed_shape():
  space = gym.spaces.Dict({"name": gym.spaces.Text(5)})
  with pytest.raises(TypeError, match=r"space\['name'\] is a Text"):
    jaxbuf.example_from_space(space)


def test_import_jaxbuf_does_not_import_gymnasium():
  code = "import sys, jaxbuf; print('gymnasium' in sys.modules)"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert result.stdout.strip() == "False"


# --- examples/gymnasium_dqn.py -----------------------------------------------


def test_recorded_transitions_keep_the_final_observation():
  """CartPole's Euler step: x' = x + 0.02 x_dot for every true successor, the
  final observation of an ended episode included, never the reset one."""
  envs = gymnasium_dqn.make_envs(gymnasium_dqn.Config())
  recorder = jaxbuf.VectorEnvRecorder(envs, jaxbuf.uniform_replay(8))
  obs, _ = envs.reset(seed=0)
  recorder.reset(obs)
  ended = 0
  for _ in range(60):
    actions = envs.action_space.sample()
    next_obs, rewards, terminated, truncated, info = envs.step(actions)
    transition = recorder.record(actions, next_obs, rewards, terminated, truncated, info).items
    np.testing.assert_allclose(transition.next_obs[:, 0], obs[:, 0] + 0.02 * obs[:, 1], atol=1e-6)
    assert transition.reward.dtype == np.float32
    ended += int((terminated | truncated).sum())
    obs = next_obs
  envs.close()
  assert ended > 0


@pytest.mark.parametrize(
  "mode",
  [[], ["--natural"], ["--natural", "--replay", "prioritized"]],
  ids=["recipe", "natural", "natural-prioritized"],
)
def test_gymnasium_dqn_runs(mode, capsys, tmp_path):
  plot = tmp_path / "returns.png"
  gymnasium_dqn.main(
    [
      "--total-steps",
      "240",
      "--learning-starts",
      "40",
      "--buffer-size",
      "64",
      "--batch-size",
      "8",
      "--hidden-size",
      "8",
      "--target-update-interval",
      "16",
      "--no-progress",
      "--plot",
      str(plot),
      *mode,
    ]
  )
  last_line = capsys.readouterr().out.strip().splitlines()[-1]
  assert last_line.startswith("final mean return: ")
  assert float(last_line.split(": ")[1]) > 0
  assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_gymnasium_dqn_recipe_learns_cartpole():
  result = gymnasium_dqn.train(gymnasium_dqn.Config(progress=False))
  assert result["final_mean_return"] >= 400
