"""Sum tree against NumPy: writes, duplicates, descents, and long-run totals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbuf._src import sum_tree


def _numpy_levels(leaf_values: np.ndarray) -> list[np.ndarray]:
  """Reference: every level's node sums, in float64, bottom-up."""
  levels = [leaf_values.astype(np.float64)]
  while levels[-1].size > 1:
    child = levels[-1]
    padded = np.zeros(-(-child.size // sum_tree.BRANCHING) * sum_tree.BRANCHING)
    padded[:child.size] = child
    levels.append(padded.reshape(-1, sum_tree.BRANCHING).sum(axis=1))
  return levels


@pytest.mark.parametrize("num_leaves", [1, 2, 31, 32, 33, 1000, 32 ** 2 + 5])
def test_level_sizes_cover_leaves_and_end_at_root(num_leaves):
  sizes = sum_tree.level_sizes(num_leaves)
  assert sizes[-1] == 1
  assert sizes[0] >= num_leaves
  for child, parent in zip(sizes[:-1], sizes[1:]):
    assert child % sum_tree.BRANCHING == 0
    assert child // sum_tree.BRANCHING <= max(parent, 1)


@pytest.mark.parametrize("num_leaves, batch, marked_batch_max", [
    (1500, 300, None),     # every level small enough to be summed whole
    (40_000, 300, None),   # the lowest levels updated sparsely, node by node
    (40_000, 1500, 64),    # a batch over MARKED_BATCH_MAX, written in chunks
])
def test_set_leaves_matches_numpy_at_every_level(num_leaves, batch,
                                                 marked_batch_max, monkeypatch):
  assert (num_leaves > sum_tree.DENSE_LEVEL_MAX) == (num_leaves == 40_000)
  if marked_batch_max is not None:
    monkeypatch.setattr(sum_tree, "MARKED_BATCH_MAX", marked_batch_max)
  rng = np.random.default_rng(0)
  tree = sum_tree.init(num_leaves)
  reference = np.zeros(num_leaves)
  for _ in range(5):
    indices = rng.integers(0, num_leaves // 10, batch)  # many duplicates
    values = rng.uniform(0, 10, batch).astype(np.float32)
    valid = rng.random(batch) < 0.8
    tree = sum_tree.set_leaves(tree, indices, values, valid)
    for i, v, ok in zip(indices, values, valid):
      if ok:
        reference[i] = v
  for level, expected in zip(tree.levels, _numpy_levels(reference)):
    np.testing.assert_allclose(np.asarray(level)[:expected.size], expected,
                               rtol=1e-6)
    assert not np.any(np.asarray(level)[expected.size:])


def test_duplicate_indices_last_valid_occurrence_wins():
  tree = sum_tree.init(8)
  indices = jnp.array([3, 5, 3, 3, 5, 6])
  values = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
  valid = jnp.array([True, True, True, False, True, False])
  tree = sum_tree.set_leaves(tree, indices, values, valid)
  np.testing.assert_array_equal(sum_tree.leaves(tree)[:8],
                                [0, 0, 0, 3.0, 0, 5.0, 0, 0])
  assert sum_tree.total(tree) == 8.0


def test_duplicates_resolve_next_to_leaves_at_the_largest_allowed_value():
  """Markers sit above every allowed leaf value, however large the leaves."""
  largest = np.nextafter(np.float32(sum_tree.LEAF_VALUE_LIMIT), np.float32(0))
  tree = sum_tree.set_leaves(sum_tree.init(16), jnp.array([2, 5]),
                             jnp.array([largest, largest]))
  tree = sum_tree.set_leaves(tree, jnp.array([2, 2, 9, 2, 5]),
                             jnp.array([largest, 1.0, 2.0, 3.0, 4.0]),
                             jnp.array([True, True, True, True, False]))
  leaves = np.asarray(sum_tree.leaves(tree))
  assert leaves[2] == 3.0 and leaves[9] == 2.0 and leaves[5] == largest
  assert np.count_nonzero(leaves) == 3


@pytest.mark.parametrize("batch", [1, 200, 1500])
def test_claim_last_writes_marks_one_per_distinct_index(batch):
  rng = np.random.default_rng(1)
  indices = rng.integers(0, 20, batch)
  valid = rng.random(batch) < 0.7
  leaf_level = jnp.asarray(rng.uniform(0, 5, 24), jnp.float32)
  claimed, marked = sum_tree.claim_last_writes(
      leaf_level, jnp.asarray(indices, jnp.int32), jnp.asarray(valid))
  marked = np.asarray(marked)
  for index in np.unique(indices):
    positions = np.flatnonzero((indices == index) & valid)
    np.testing.assert_array_equal(np.flatnonzero(marked & (indices == index)),
                                  positions[-1:])
  written = np.isin(np.arange(24), indices[valid])
  assert np.all(np.asarray(claimed)[written] >= sum_tree.LEAF_VALUE_LIMIT)
  np.testing.assert_array_equal(np.asarray(claimed)[~written],
                                np.asarray(leaf_level)[~written])


def test_find_prefix_sums_matches_searchsorted():
  rng = np.random.default_rng(2)
  num_leaves = 3000
  values = rng.uniform(0, 1, num_leaves).astype(np.float32)
  values[rng.random(num_leaves) < 0.3] = 0.0
  tree = sum_tree.set_leaves(sum_tree.init(num_leaves), jnp.arange(num_leaves),
                             values)
  total = float(sum_tree.total(tree))
  targets = rng.uniform(0, total, 5000).astype(np.float32)
  found = np.asarray(sum_tree.find_prefix_sums(tree, targets))
  prefix = np.cumsum(values.astype(np.float64))
  expected = np.searchsorted(prefix, targets, side="right")
  # Targets within float32 rounding of a boundary may land on either side.
  near_boundary = np.abs(prefix[np.minimum(expected, num_leaves - 1)] - targets) < 1e-3
  agree = (found == expected) | near_boundary
  assert agree.mean() == 1.0
  assert np.all(values[found] > 0)


@pytest.mark.parametrize("targets", [[0.0], [1.0], [1e30], [np.inf], [-1.0]])
def test_descent_never_returns_a_zero_leaf(targets):
  tree = sum_tree.set_leaves(sum_tree.init(100), jnp.array([17, 64]),
                             jnp.array([0.25, 0.75]))
  found = sum_tree.find_prefix_sums(tree, jnp.asarray(targets, jnp.float32))
  assert int(found[0]) in (17, 64)


def test_root_tracks_leaf_sum_over_a_million_batched_updates():
  """10^6 random updates (977 batches of 1024): no drift, to float32 precision."""
  num_leaves, batch, steps = 50_000, 1024, 977
  def step(tree, key):
    index_key, value_key = jax.random.split(key)
    indices = jax.random.randint(index_key, (batch,), 0, num_leaves)
    values = jax.random.uniform(value_key, (batch,), minval=0.0, maxval=100.0)
    return sum_tree.set_leaves(tree, indices, values), None
  keys = jax.random.split(jax.random.key(3), steps)
  tree, _ = jax.jit(lambda t: jax.lax.scan(step, t, keys))(sum_tree.init(num_leaves))
  assert steps * batch >= 10**6
  leaves = np.asarray(sum_tree.leaves(tree), np.float64)
  np.testing.assert_allclose(float(sum_tree.total(tree)), leaves.sum(), rtol=2e-6)
  for level, expected in zip(tree.levels, _numpy_levels(leaves[:num_leaves])):
    np.testing.assert_allclose(np.asarray(level)[:expected.size], expected,
                               rtol=2e-6)
