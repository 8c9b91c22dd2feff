"""Sum tree against NumPy: writes, duplicates, descents, and long-run totals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxbuf._src.core import sum_tree


def _numpy_levels(leaf_values: np.ndarray) -> list[np.ndarray]:
  """Reference: every level's node sums, in float64, bottom-up."""
  levels = [leaf_values.astype(np.float64)]
  while levels[-1].size > 1:
    child = levels[-1]
    padded = np.zeros(-(-child.size // sum_tree.BRANCHING) * sum_tree.BRANCHING)
    padded[: child.size] = child
    levels.append(padded.reshape(-1, sum_tree.BRANCHING).sum(axis=1))
  return levels


@pytest.mark.parametrize("num_leaves", [1, 2, 31, 32, 33, 1000, 32**2 + 5])
def test_level_sizes_cover_leaves_and_end_at_root(num_leaves):
  sizes = sum_tree.level_sizes(num_leaves)
  assert sizes[-1] == 1
  assert sizes[0] >= num_leaves
  for child, parent in zip(sizes[:-1], sizes[1:]):
    assert child % sum_tree.BRANCHING == 0
    assert child // sum_tree.BRANCHING <= max(parent, 1)


@pytest.mark.parametrize(
  "num_leaves, batch, marked_batch_max",
  [
    (1500, 300, None),  # every level small enough to be summed whole
    (40_000, 300, None),  # the lowest levels updated sparsely, node by node
    (40_000, 1500, 64),  # a batch over MARKED_BATCH_MAX, written in chunks
  ],
)
def test_set_leaves_matches_numpy_at_every_level(num_leaves, batch, marked_batch_max, monkeypatch):
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
    np.testing.assert_allclose(np.asarray(level)[: expected.size], expected, rtol=1e-6)
    assert not np.any(np.asarray(level)[expected.size :])


def test_duplicate_indices_last_valid_occurrence_wins():
  tree = sum_tree.init(8)
  indices = jnp.array([3, 5, 3, 3, 5, 6])
  values = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
  valid = jnp.array([True, True, True, False, True, False])
  tree = sum_tree.set_leaves(tree, indices, values, valid)
  np.testing.assert_array_equal(sum_tree.leaves(tree)[:8], [0, 0, 0, 3.0, 0, 5.0, 0, 0])
  assert sum_tree.total(tree) == 8.0


def test_duplicates_resolve_next_to_leaves_at_the_largest_allowed_value():
  """Markers sit above every allowed leaf value, however large the leaves."""
  largest = np.nextafter(np.float32(sum_tree.LEAF_VALUE_LIMIT), np.float32(0))
  tree = sum_tree.set_leaves(sum_tree.init(16), jnp.array([2, 5]), jnp.array([largest, largest]))
  tree = sum_tree.set_leaves(
    tree,
    jnp.array([2, 2, 9, 2, 5]),
    jnp.array([largest, 1.0, 2.0, 3.0, 4.0]),
    jnp.array([True, True, True, True, False]),
  )
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
    leaf_level, jnp.asarray(indices, jnp.int32), jnp.asarray(valid)
  )
  marked = np.asarray(marked)
  for index in np.unique(indices):
    positions = np.flatnonzero((indices == index) & valid)
    np.testing.assert_array_equal(np.flatnonzero(marked & (indices == index)), positions[-1:])
  written = np.isin(np.arange(24), indices[valid])
  assert np.all(np.asarray(claimed)[written] >= sum_tree.LEAF_VALUE_LIMIT)
  np.testing.assert_array_equal(np.asarray(claimed)[~written], np.asarray(leaf_level)[~written])


def test_find_prefix_sums_matches_searchsorted():
  rng = np.random.default_rng(2)
  num_leaves = 500  # at most 8**3 leaves: one target per descent, no redraw
  assert sum_tree.num_redraws(sum_tree.init(num_leaves)) == 0
  values = rng.uniform(0, 1, num_leaves).astype(np.float32)
  values[rng.random(num_leaves) < 0.3] = 0.0
  tree = sum_tree.set_leaves(sum_tree.init(num_leaves), jnp.arange(num_leaves), values)
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


def _leaf_levels(leaf_values: np.ndarray) -> sum_tree.SumTree:
  """A tree built directly from its leaves, in float32, without any writes."""
  levels = []
  level = np.asarray(leaf_values, np.float32)
  for size in sum_tree.level_sizes(leaf_values.size):
    padded = np.zeros(size, np.float32)
    padded[: level.size] = level
    levels.append(jnp.asarray(padded))
    if size == 1:
      break
    level = padded.reshape(-1, sum_tree.BRANCHING).sum(axis=1, dtype=np.float32)
  return sum_tree.SumTree(tuple(levels))


def test_redraws_descend_within_the_node_reached():
  """Top levels follow the target; below them, the redraw within that node."""
  rng = np.random.default_rng(4)
  num_leaves = 5000  # 5 levels below the root: one redraw, after 3 of them
  values = rng.uniform(0, 1, num_leaves).astype(np.float32)
  values[rng.random(num_leaves) < 0.3] = 0.0
  tree = _leaf_levels(values)
  assert sum_tree.num_redraws(tree) == 1
  # Leaves under a node 3 levels below the root.
  block = sum_tree.BRANCHING ** (len(tree.levels) - 1 - sum_tree.LEVELS_PER_TARGET)
  assert block == 64
  padded = np.zeros(-(-num_leaves // block) * block)
  padded[:num_leaves] = values
  block_sums = padded.reshape(-1, block).sum(axis=1)
  count = 4000
  targets = rng.uniform(0, block_sums.sum(), count).astype(np.float32)
  redraws = rng.uniform(0, 1, (1, count)).astype(np.float32)
  found, found_values = sum_tree.find_prefix_sums_and_leaves(tree, targets, redraws)
  found, found_values = np.asarray(found), np.asarray(found_values)
  block_prefix = np.cumsum(block_sums)
  chosen_block = np.searchsorted(block_prefix, targets, side="right")
  within = redraws[0] * block_sums[np.minimum(chosen_block, block_sums.size - 1)]
  leaf_prefix = np.cumsum(
    padded.reshape(-1, block)[np.minimum(chosen_block, block_sums.size - 1)], axis=1
  )
  expected = chosen_block * block + np.array(
    [np.searchsorted(row, t, side="right") for row, t in zip(leaf_prefix, within)]
  )
  near_boundary = (np.min(np.abs(block_prefix[None, :] - targets[:, None]), axis=1) < 1e-3) | (
    np.min(np.abs(leaf_prefix - within[:, None]), axis=1) < 1e-5
  )
  assert np.mean((found == expected) | near_boundary) == 1.0
  assert np.mean(near_boundary) < 0.01
  np.testing.assert_array_equal(found_values, values[found])
  assert np.all(values[found] > 0)


def test_a_descent_of_a_deep_tree_without_its_redraws_is_refused():
  tree = sum_tree.init(5000)
  with pytest.raises(ValueError, match=r"needs redraws of shape \(1, 3\)"):
    sum_tree.find_prefix_sums(tree, jnp.zeros(3))
  with pytest.raises(ValueError, match="needs redraws"):
    sum_tree.find_prefix_sums(tree, jnp.zeros(3), jnp.zeros((2, 3)))


@pytest.mark.parametrize("redraw", [True, False])
def test_every_leaf_is_drawn_in_proportion_past_2_to_the_24_leaves(redraw, monkeypatch):
  """3 * 2**23 leaves of 1, 2, 3, 1, 2, 3, ...: each residue of the index
  modulo 6 is drawn in proportion in each third of the leaves.

  A float32 target alone cannot reach every leaf here (its ulp near the total
  is 4 leaves' mass): with the redraws turned off the same test must fail.
  The tree is built directly from its leaves (110 MB), not by writes.
  """
  if not redraw:
    monkeypatch.setattr(sum_tree, "LEVELS_PER_TARGET", 100)
  num_leaves = 3 * 2**23
  tree = _leaf_levels(np.tile(np.array([1, 2, 3], np.float32), num_leaves // 3))
  draw = jax.jit(lambda key: sum_tree.sample_leaves(tree, key, 2**16, stratified=False))
  found = np.concatenate(
    [np.asarray(draw(key)[0]) for key in jax.random.split(jax.random.key(5), 4)]
  )
  expected_shares = np.array([1, 2, 3, 1, 2, 3]) / 12
  p_values = []
  for third in range(3):
    chosen = found[(found >= third * 2**23) & (found < (third + 1) * 2**23)]
    counts = np.bincount(chosen % 6, minlength=6)
    p_values.append(scipy.stats.chisquare(counts, expected_shares * counts.sum()).pvalue)
  if redraw:
    assert min(p_values) > 1e-3, p_values
  else:
    assert min(p_values) < 1e-12, p_values


@pytest.mark.parametrize("targets", [[0.0], [1.0], [1e30], [np.inf], [-1.0]])
def test_descent_never_returns_a_zero_leaf(targets):
  tree = sum_tree.set_leaves(sum_tree.init(100), jnp.array([17, 64]), jnp.array([0.25, 0.75]))
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
    np.testing.assert_allclose(np.asarray(level)[: expected.size], expected, rtol=2e-6)
