"""Minibatch shuffles are permutations: every step (or sequence) exactly once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

T, N = 8, 6


def labelled_rollout():
  """`[T, N]` leaves whose values name their (t, n) slot."""
  step_id = np.arange(T * N, dtype=np.int32).reshape(T, N)
  return {
    "step_id": step_id,
    "obs": np.stack([step_id, -step_id], axis=-1).astype(np.float32),
    "hidden": (
      step_id.astype(np.float32)[..., None] * np.ones(4, np.float32),
      np.zeros((T, N, 2), np.float32),
    ),
  }


def test_shuffled_minibatches_are_a_permutation_with_aligned_leaves():
  data = labelled_rollout()
  minibatches = jax.jit(jaxbuf.shuffled_minibatches, static_argnames="num_minibatches")(
    jax.random.key(0), data, num_minibatches=4
  )
  ids = np.asarray(minibatches["step_id"])
  assert ids.shape == (4, T * N // 4)
  np.testing.assert_array_equal(np.sort(ids.ravel()), np.arange(T * N))
  assert not np.array_equal(ids.ravel(), np.arange(T * N))  # actually shuffled
  np.testing.assert_array_equal(minibatches["obs"][..., 0], ids)
  np.testing.assert_array_equal(minibatches["obs"][..., 1], -ids)
  np.testing.assert_array_equal(minibatches["hidden"][0][..., 3], ids)


def test_epochs_in_scan_see_every_valid_step_once_each_in_a_new_order():
  data = labelled_rollout()
  data["valid"] = np.arange(T)[:, None] < np.array([8, 3, 0, 5, 8, 1])[None, :]
  num_epochs = 3

  @jax.jit
  def update(key):
    def epoch(counts, key):
      minibatches = jaxbuf.shuffled_minibatches(key, data, num_minibatches=3)

      def step(counts, minibatch):
        ids = minibatch["step_id"]
        return counts.at[ids].add(minibatch["valid"].astype(jnp.int32)), ids

      return jax.lax.scan(step, counts, minibatches)

    return jax.lax.scan(epoch, jnp.zeros(T * N, jnp.int32), jax.random.split(key, num_epochs))

  counts, orders = update(jax.random.key(1))
  np.testing.assert_array_equal(counts, num_epochs * data["valid"].ravel().astype(int))
  orders = np.asarray(orders).reshape(num_epochs, -1)
  assert len({tuple(order) for order in orders}) == num_epochs
  update(jax.random.key(2))
  assert update._cache_size() == 1


def test_env_minibatches_keep_columns_whole_and_in_time_order():
  data = labelled_rollout()
  valid = np.arange(T)[:, None] < np.array([8, 3, 0, 5, 8, 1])[None, :]
  batches = jaxbuf.env_minibatches(
    jax.random.key(3), data, data["hidden"], num_minibatches=3, valid=valid
  )
  ids = np.asarray(batches.data["step_id"])  # [M, T, E]
  assert ids.shape == (3, T, 2)
  envs = ids[:, 0, :] % N  # env of each sequence
  np.testing.assert_array_equal(np.sort(envs.ravel()), np.arange(N))
  for m in range(3):
    for e in range(2):
      np.testing.assert_array_equal(ids[m, :, e], np.arange(T) * N + envs[m, e])
      np.testing.assert_array_equal(batches.valid[m, :, e], valid[:, envs[m, e]])
      np.testing.assert_array_equal(
        batches.initial_hidden[0][m, e], data["hidden"][0][0, envs[m, e]]
      )
  assert batches.initial_hidden[1].shape == (3, 2, 2)


def test_sequence_chunks_start_at_their_stored_hidden_state():
  data = labelled_rollout()
  batches = jax.jit(jaxbuf.sequence_chunks, static_argnames=("chunk_length", "num_minibatches"))(
    jax.random.key(4), data, data["hidden"], chunk_length=4, num_minibatches=4
  )
  ids = np.asarray(batches.data["step_id"])  # [M, L, E]
  assert ids.shape == (4, 4, 3)
  assert batches.valid.shape == (4, 4, 3) and bool(batches.valid.all())
  starts = ids[:, 0, :].ravel()
  # Every (chunk, env) pair once: chunk starts are t in {0, 4}, every env.
  np.testing.assert_array_equal(
    np.sort(starts), np.sort(np.concatenate([np.arange(N), 4 * N + np.arange(N)]))
  )
  np.testing.assert_array_equal(
    ids - ids[:, :1, :], np.broadcast_to(np.arange(4)[None, :, None] * N, ids.shape)
  )
  np.testing.assert_array_equal(batches.initial_hidden[0][..., 0], ids[:, 0, :].astype(np.float32))


def test_bad_arguments_fail_while_tracing():
  data = labelled_rollout()
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="num_minibatches=5 must be positive"):
    jaxbuf.shuffled_minibatches(key, data, num_minibatches=5)
  with pytest.raises(TypeError, match="Python int"):
    jaxbuf.shuffled_minibatches(key, data, num_minibatches=jnp.int32(4))
  with pytest.raises(ValueError, match=r"leaf \['late'\] has shape \(7, 6\)"):
    jaxbuf.shuffled_minibatches(key, {**data, "late": np.zeros((7, 6))}, num_minibatches=4)
  with pytest.raises(ValueError, match="chunk_length=3"):
    jaxbuf.sequence_chunks(key, data, data["hidden"], chunk_length=3, num_minibatches=2)
  with pytest.raises(ValueError, match="num_minibatches=4 must be positive"):
    jaxbuf.env_minibatches(key, data, data["hidden"], num_minibatches=4)
  with pytest.raises(ValueError, match="hidden"):
    jaxbuf.env_minibatches(key, data, np.zeros((T, N + 1, 4)), num_minibatches=3)
  with pytest.raises(ValueError, match="valid has shape"):
    jaxbuf.env_minibatches(key, data, data["hidden"], num_minibatches=3, valid=np.ones((T,), bool))
  with pytest.raises(TypeError, match="key"):
    jaxbuf.shuffled_minibatches(0, data, num_minibatches=4)
  with pytest.raises(TypeError, match="num_minibatches must be a Python int"):
    jaxbuf.shuffled_minibatches(key, data, num_minibatches=True)
  with pytest.raises(ValueError, match="num_batch_axes must be positive"):
    jaxbuf.shuffled_minibatches(key, data, num_minibatches=4, num_batch_axes=0)
  with pytest.raises(TypeError, match="chunk_length must be a Python int"):
    jaxbuf.sequence_chunks(key, data, data["hidden"], chunk_length=4.0, num_minibatches=2)
  with pytest.raises(TypeError, match="sequence_chunks: valid must be bool"):
    jaxbuf.sequence_chunks(
      key, data, data["hidden"], chunk_length=4, num_minibatches=2, valid=np.full((T, N), "yes")
    )
  with pytest.raises(ValueError, match="empty|no leaves"):
    jaxbuf.shuffled_minibatches(key, {}, num_minibatches=1)


def test_vmap_over_keys_gives_independent_shuffles():
  data = labelled_rollout()
  keys = jax.random.split(jax.random.key(5), 4)
  batches = jax.vmap(lambda key: jaxbuf.shuffled_minibatches(key, data, num_minibatches=2))(keys)
  ids = np.asarray(batches["step_id"]).reshape(4, -1)
  for row in ids:
    np.testing.assert_array_equal(np.sort(row), np.arange(T * N))
  assert len({tuple(row) for row in ids}) == 4


def test_permutations_are_uniform():
  # 24 orders of 4 items, 4800 draws: chi-square against uniform, fixed seed.
  # The threshold p > 1e-3 fails a correct sampler for 1 seed in 1000.
  scipy_stats = pytest.importorskip("scipy.stats")
  keys = jax.random.split(jax.random.key(11), 4800)
  orders = np.asarray(jax.vmap(lambda key: jaxbuf._src.core.random.permutation(key, 4))(keys))
  codes = orders @ np.array([64, 16, 4, 1])
  _, counts = np.unique(codes, return_counts=True)
  assert len(counts) == 24
  assert scipy_stats.chisquare(counts).pvalue > 1e-3
