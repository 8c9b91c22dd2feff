"""jaxbuf.mixture: rows per part, routing, statistics, errors, composability."""

import fractions
import os

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from jax.experimental import checkify

import jaxbuf
from tests import devices

CHECK_FAILED = checkify.JaxRuntimeError
ITEM = {"obs": jnp.zeros(3, jnp.float32), "action": jnp.int32(0)}


def items(start: int, count: int, part: int = 0) -> dict:
  """Items whose `action` is `1000 * part + position`, so a row names its
  part and the item it holds."""
  ids = np.arange(start, start + count)
  return {
    "obs": jnp.asarray(np.stack([ids] * 3, 1), jnp.float32),
    "action": jnp.asarray(1000 * part + ids, jnp.int32),
  }


def two_parts(offline_items: int = 10, online_items: int = 6, proportions=(0.5, 0.5)):
  """A uniform part (offline data) and a prioritized part (online replay)."""
  offline = jaxbuf.uniform_replay(16)
  online = jaxbuf.prioritized_replay(16, alpha=1.0, beta=0.5)
  mix = jaxbuf.mixture([offline, online], list(proportions))
  states = [offline.init(ITEM), online.init(ITEM)]
  if offline_items:
    states[0] = offline.add(states[0], items(0, offline_items, part=0))
  if online_items:
    states[1] = online.add(states[1], items(0, online_items, part=1))
  return mix, states


def snapshot(tree):
  return jax.tree.map(lambda leaf: np.asarray(leaf).copy(), tree)


# --- Rows per part: a NumPy reference ------------------------------------------------


def reference_rows(batch_size: int, proportions: list[int]) -> list[int]:
  """Largest remainder with integer proportions: exact in NumPy integers.
  Ties go to the lower part index (a stable sort of the remainders)."""
  weights = np.asarray(proportions, np.int64)
  total = weights.sum()
  rows = batch_size * weights // total
  remainders = batch_size * weights % total
  order = np.argsort(-remainders, kind="stable")
  rows[order[: batch_size - rows.sum()]] += 1
  return rows.tolist()


@hypothesis.given(
  batch_size=st.integers(1, 600),
  proportions=st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any),
)
def test_rows_per_part_match_the_largest_remainder_reference(batch_size, proportions):
  mix = jaxbuf.mixture([jaxbuf.uniform_replay(4)] * len(proportions), proportions)
  rows = mix.rows(batch_size)
  assert list(rows) == reference_rows(batch_size, proportions)
  assert sum(rows) == batch_size and all(type(r) is int for r in rows)
  shares = [fractions.Fraction(batch_size * p, sum(proportions)) for p in proportions]
  assert all(abs(r - share) < 1 for r, share in zip(rows, shares))
  assert all(r == 0 for r, p in zip(rows, proportions) if p == 0)


@hypothesis.given(
  batch_size=st.integers(1, 300),
  proportions=st.lists(st.floats(0, 10), min_size=1, max_size=5).filter(any),
)
def test_float_rows_are_exact_and_within_one_row(batch_size, proportions):
  mix = jaxbuf.mixture([jaxbuf.uniform_replay(4)] * len(proportions), proportions)
  rows = mix.rows(batch_size)
  exact = [fractions.Fraction(p) for p in proportions]
  shares = [batch_size * p / sum(exact) for p in exact]
  assert sum(rows) == batch_size
  assert all(abs(r - share) < 1 for r, share in zip(rows, shares))
  # The rows left over went to the largest remainders.
  extra = [k for k, (r, s) in enumerate(zip(rows, shares)) if r > s]
  floor = [k for k, (r, s) in enumerate(zip(rows, shares)) if r <= s]
  assert all(shares[i] - int(shares[i]) >= shares[j] - int(shares[j]) for i in extra for j in floor)
  np.testing.assert_allclose(sum(mix.proportions), 1.0)


def test_rows_for_the_usual_mixtures():
  halves = jaxbuf.mixture([jaxbuf.uniform_replay(4)] * 2, [1, 1])
  assert [halves.rows(s) for s in (1, 2, 3, 256)] == [(1, 0), (1, 1), (2, 1), (128, 128)]
  tenth = jaxbuf.mixture([jaxbuf.uniform_replay(4)] * 2, [0.1, 0.9])
  assert tenth.rows(256) == (26, 230)  # 25.6 and 230.4
  assert jaxbuf.mixture([jaxbuf.uniform_replay(4)] * 3, [0.0, 2.0, 1.0]).rows(5) == (0, 3, 2)


# --- Routing: the rows are each part's own sample -------------------------------------


@pytest.mark.usefixtures("x64_mode")
def test_rows_are_each_parts_own_sample_in_part_order():
  mix, states = two_parts()
  key = jax.random.key(3)
  batch = mix.sample(states, key, 7)
  rows = mix.rows(7)
  assert rows == (4, 3)
  np.testing.assert_array_equal(batch.source, [0, 0, 0, 0, 1, 1, 1])
  assert batch.source.dtype == jnp.int32 and batch.weights.dtype == jnp.float32
  assert batch.items["action"].dtype == jnp.int32
  assert batch.items["obs"].dtype == jnp.float32
  start = 0
  for k, (buffer, state, part) in enumerate(zip(mix.buffers, states, batch.parts)):
    # Part k draws with fold_in(key, k): its buffer's own sample.
    direct = buffer.sample(state, jax.random.fold_in(key, k), rows[k])
    chex.assert_trees_all_equal(part, direct)
    rows_k = slice(start, start + rows[k])
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x, rows_k=rows_k: x[rows_k], batch.items), direct.items
    )
    np.testing.assert_array_equal(batch.weights[rows_k], direct.weights)
    assert np.all(np.asarray(batch.items["action"][rows_k]) // 1000 == k)
    start += rows[k]


def test_a_part_without_rows_is_an_empty_sample_of_its_type():
  mix, states = two_parts()
  batch = mix.sample(states, jax.random.key(0), 1)
  assert mix.rows(1) == (1, 0)
  assert batch.parts[1].indices.shape == (0,)
  assert type(batch.parts[1]) is jaxbuf.ReplaySample
  assert batch.parts[1].items["obs"].shape == (0, 3)
  states = mix.update_priorities(states, batch, jnp.ones(1))
  zero = jaxbuf.mixture(mix.buffers, [1.0, 0.0])
  batch = zero.sample(states, jax.random.key(0), 8)
  np.testing.assert_array_equal(batch.source, np.zeros(8))


# --- Statistics within each part -------------------------------------------------------


def test_each_part_draws_from_its_own_distribution():
  """Over 400 keys, batches of 10 (5 rows a part): the uniform part's rows
  are uniform over its 8 items, the prioritized part's follow p^alpha
  (alpha 1), chi-square p > 1e-3 for each, fixed seed."""
  offline = jaxbuf.uniform_replay(8)
  online = jaxbuf.prioritized_replay(8, alpha=1.0)
  mix = jaxbuf.mixture([offline, online], [1, 1])
  states = [
    offline.add(offline.init(ITEM), items(0, 8, part=0)),
    online.add(online.init(ITEM), items(0, 5, part=1)),
  ]
  priorities = np.array([1.0, 2.0, 3.0, 4.0, 10.0], np.float32)
  states[1] = online.update_priorities(states[1], jnp.arange(5), priorities)
  keys = jax.random.split(jax.random.key(2026), 400)
  actions = np.asarray(jax.vmap(lambda k: mix.sample(states, k, 10).items["action"])(keys))
  offline_rows, online_rows = actions[:, :5].ravel(), actions[:, 5:].ravel()
  assert np.all(offline_rows < 1000) and np.all(online_rows >= 1000)
  uniform_counts = np.bincount(offline_rows, minlength=8)
  assert scipy.stats.chisquare(uniform_counts).pvalue > 1e-3
  counts = np.bincount(online_rows - 1000, minlength=5)
  masses = priorities.astype(np.float64) + 1e-6
  expected = masses / masses.sum() * counts.sum()
  assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3


def test_weights_are_each_parts_own_and_an_empty_part_gives_weight_0():
  mix, states = two_parts(offline_items=0, online_items=6)
  states[1] = mix.buffers[1].update_priorities(states[1], jnp.arange(6), jnp.arange(1.0, 7.0))
  batch = mix.sample(states, jax.random.key(1), 8)
  np.testing.assert_array_equal(batch.weights[:4], 0.0)  # empty uniform part
  online = batch.weights[4:]
  assert float(online.max()) == 1.0 and float(online.min()) < 1.0
  assert not bool(mix.can_sample(states, 8))
  # Only the parts with rows are asked: one row goes to the empty part 0,
  # none to part 1.
  online_only = jaxbuf.mixture(mix.buffers, [0, 1])
  assert bool(online_only.can_sample(states, 6))


# --- update_priorities: each part's rows to its own buffer ---------------------------


@pytest.mark.usefixtures("x64_mode")
def test_update_priorities_routes_each_parts_rows_like_direct_updates():
  online_a = jaxbuf.prioritized_replay(16, alpha=0.7)
  offline = jaxbuf.uniform_replay(16)
  online_b = jaxbuf.prioritized_replay(16, alpha=1.0)
  mix = jaxbuf.mixture([online_a, offline, online_b], [2, 1, 1])
  states = [
    online_a.add(online_a.init(ITEM), items(0, 9, 0)),
    offline.add(offline.init(ITEM), items(0, 9, 1)),
    online_b.add(online_b.init(ITEM), items(0, 9, 2)),
  ]
  batch = mix.sample(states, jax.random.key(4), 9)
  rows = mix.rows(9)
  assert rows == (5, 2, 2)
  priorities = np.linspace(0.5, 4.5, 9).astype(np.float32)
  expected, start = [], 0
  for buffer, state, part, count in zip(mix.buffers, states, batch.parts, rows):
    expected.append(
      snapshot(
        buffer.update_priorities(
          jax.tree.map(jnp.copy, state),
          part.indices,
          priorities[start : start + count],
          part.item_ids,
        )
      )
    )
    start += count
  offline_before = snapshot(states[1])
  updated = mix.update_priorities(states, batch, priorities)
  assert isinstance(updated, list) and len(updated) == 3
  chex.assert_trees_all_equal(snapshot(updated), expected)
  chex.assert_trees_all_equal(snapshot(updated[1]), offline_before)


def test_stale_ids_are_skipped_as_the_part_skips_them():
  online = jaxbuf.prioritized_replay(4, alpha=1.0)
  mix = jaxbuf.mixture([online, jaxbuf.uniform_replay(4)], [1, 1])
  states = [
    online.add(online.init(ITEM), items(0, 4)),
    mix.buffers[1].add(mix.buffers[1].init(ITEM), items(0, 4, 1)),
  ]
  batch = mix.sample(states, jax.random.key(0), 4)
  leaves_before = np.asarray(states[0].sum_tree.levels[0]).copy()
  # Every slot of part 0 is overwritten after the draw: its rows are stale.
  states[0] = online.add(states[0], items(10, 4))
  leaves_after_add = np.asarray(states[0].sum_tree.levels[0]).copy()
  states = mix.update_priorities(states, batch, jnp.full(4, 7.0))
  np.testing.assert_array_equal(states[0].sum_tree.levels[0], leaves_after_add)
  assert leaves_before.shape == leaves_after_add.shape


def test_update_priorities_donates_the_states_and_keeps_the_container():
  mix, states = two_parts()
  batch = mix.sample(states, jax.random.key(0), 4)
  old = states[1]
  updated = mix.update_priorities(tuple(states), batch, jnp.ones(4))
  assert isinstance(updated, tuple)
  assert old.sum_tree.levels[0].is_deleted()  # updated in place
  with pytest.raises(ValueError, match="donated to an earlier call"):
    mix.sample(states, jax.random.key(0), 4)


# --- Bad input: clear errors, state intact -------------------------------------------


@pytest.mark.parametrize(
  "proportions, error, words",
  [
    ([1.0, -0.5], ValueError, ["proportions[1]", "non-negative", "-0.5"]),
    ([0, 0.0], ValueError, ["all 0"]),
    ([1.0], ValueError, ["1 proportions for 2 buffers"]),
    ([1.0, 1.0, 1.0], ValueError, ["3 proportions for 2 buffers"]),
    ([1.0, float("nan")], ValueError, ["proportions[1]", "finite"]),
    ([1.0, True], ValueError, ["proportions[1]"]),
    ([1.0, "a"], TypeError, ["proportions[1]", "real number"]),
    (0.5, TypeError, ["sequence of numbers"]),
  ],
)
def test_bad_proportions_are_refused_naming_the_entry(proportions, error, words):
  buffers = [jaxbuf.uniform_replay(4), jaxbuf.prioritized_replay(4)]
  with pytest.raises(error) as raised:
    jaxbuf.mixture(buffers, proportions)
  for word in words:
    assert word in str(raised.value)


def test_bad_buffers_are_refused():
  with pytest.raises(TypeError, match="list of jaxbuf.Buffer"):
    jaxbuf.mixture(jaxbuf.uniform_replay(4), [1.0])
  with pytest.raises(ValueError, match="empty"):
    jaxbuf.mixture([], [])
  with pytest.raises(TypeError, match=r"buffers\[1\] must be a jaxbuf.Buffer"):
    jaxbuf.mixture([jaxbuf.uniform_replay(4), jaxbuf.rollout_buffer(2, 2)], [1, 1])


@pytest.mark.parametrize(
  "other_item, error, words",
  [
    (
      {"obs": jnp.zeros(4), "action": jnp.int32(0)},
      ValueError,
      ["part 1 (prioritized_replay)", "leaf ['obs']", "(4,)", "expected (3,)"],
    ),
    (
      {"obs": jnp.zeros(3), "action": jnp.float32(0)},
      TypeError,
      ["part 1", "leaf ['action']", "dtype float32", "expected int32"],
    ),
    ({"obs": jnp.zeros(3)}, TypeError, ["part 1", "tree structure", "missing leaves ['action']"]),
    (
      {"obs": jnp.zeros(3), "action": jnp.int32(0), "reward": jnp.zeros(())},
      TypeError,
      ["part 1", "unexpected leaves ['reward']"],
    ),
  ],
)
def test_parts_whose_items_differ_are_refused_naming_part_and_leaf(other_item, error, words):
  offline, online = jaxbuf.uniform_replay(8), jaxbuf.prioritized_replay(8)
  mix = jaxbuf.mixture([offline, online], [1, 1])
  other = jax.tree.map(lambda x: jnp.zeros((2, *x.shape), x.dtype), other_item)
  states = [
    offline.add(offline.init(ITEM), items(0, 4)),
    online.add(online.init(other_item), other),
  ]
  before = snapshot(states)
  # Refused from shapes alone, whatever the batch size, under jit too.
  for batch_size in (4, 1):
    with pytest.raises(error) as raised:
      mix.sample(states, jax.random.key(0), batch_size)
    for word in words:
      assert word in str(raised.value)
  with pytest.raises(error):
    jax.jit(lambda s: mix.sample(s, jax.random.key(0), 4))(states)
  chex.assert_trees_all_equal(snapshot(states), before)
  mix.buffers[0].sample(states[0], jax.random.key(0), 2)  # still usable


def test_sequence_parts_of_another_window_length_are_refused():
  short = jaxbuf.sequence_replay(2, 32, 3)
  long = jaxbuf.prioritized_sequence_replay(2, 32, 4)
  step = {"obs": jnp.zeros(2)}
  states = [
    short.add(short.init(step), {"obs": jnp.ones((2, 5, 2))}),
    long.add(long.init(step), {"obs": jnp.ones((2, 5, 2))}),
  ]
  with pytest.raises(
    ValueError,
    match=r"part 1 \(prioritized_sequence_replay"
    r"\).*leaf \['obs'\] has rows of shape \(4, 2\), "
    r"expected \(3, 2\)",
  ):
    jaxbuf.mixture([short, long], [1, 1]).sample(states, jax.random.key(0), 4)
  same = jaxbuf.prioritized_sequence_replay(2, 32, 3)
  states[1] = same.add(same.init(step), {"obs": jnp.ones((2, 5, 2))})
  mix = jaxbuf.mixture([short, same], [1, 1])
  batch = mix.sample(states, jax.random.key(0), 4)
  assert batch.items["obs"].shape == (4, 3, 2)
  assert type(batch.parts[1]) is jaxbuf.SequenceSample
  states = mix.update_priorities(states, batch, jnp.ones(4))


@pytest.mark.parametrize(
  "batch_size, error, words",
  [
    (4.0, TypeError, ["mixture.sample", "batch_size must be a Python int", "float"]),
    (jnp.int32(4), TypeError, ["mixture.sample", "batch_size"]),
    (0, ValueError, ["batch_size must be positive"]),
    (True, TypeError, ["batch_size"]),
  ],
)
def test_a_batch_size_that_is_not_a_positive_int_is_refused(batch_size, error, words):
  mix, states = two_parts()
  before = snapshot(states)
  with pytest.raises(error) as raised:
    mix.sample(states, jax.random.key(0), batch_size)
  for word in words:
    assert word in str(raised.value)
  with pytest.raises(error):
    mix.can_sample(states, batch_size)
  chex.assert_trees_all_equal(snapshot(states), before)


def test_bad_states_batches_and_priorities_are_refused_with_state_intact():
  mix, states = two_parts()
  batch = mix.sample(states, jax.random.key(0), 4)
  before = snapshot(states)
  with pytest.raises(TypeError, match="one state per buffer.*given 1 states"):
    mix.sample(states[:1], jax.random.key(0), 4)
  with pytest.raises(TypeError, match="expected a PrioritizedReplayState"):
    mix.sample([states[0], states[0]], jax.random.key(0), 4)
  with pytest.raises(
    ValueError,
    match=r"priorities has shape \(3,\), "
    r"expected \(4,\)",
  ):
    mix.update_priorities(states, batch, jnp.ones(3))
  with pytest.raises(TypeError, match="priorities must be floating"):
    mix.update_priorities(states, batch, jnp.ones(4, jnp.int32))
  with pytest.raises(TypeError, match="MixtureSample"):
    mix.update_priorities(states, batch.parts[1], jnp.ones(4))
  other = jaxbuf.mixture(mix.buffers, [3, 1])
  with pytest.raises(ValueError, match=r"rows \(2, 2\) per part.*\(3, 1\)"):
    other.update_priorities(states, batch, jnp.ones(4))
  chex.assert_trees_all_equal(snapshot(states), before)
  mix.update_priorities(states, batch, jnp.ones(4))  # still usable


def test_checked_parts_raise_on_an_empty_part():
  offline = jaxbuf.uniform_replay(8, checked=True)
  online = jaxbuf.prioritized_replay(8, checked=True)
  mix = jaxbuf.mixture([offline, online], [1, 1])
  states = [offline.add(offline.init(ITEM), items(0, 4)), online.init(ITEM)]
  with pytest.raises(CHECK_FAILED, match="empty"):
    mix.sample(states, jax.random.key(0), 4)
  states[1] = online.add(states[1], items(0, 2, 1))
  batch = mix.sample(states, jax.random.key(0), 4)
  with pytest.raises(CHECK_FAILED, match="finite"):
    mix.update_priorities(states, batch, jnp.array([1.0, 1.0, jnp.nan, 1.0]))
  # Inside a jit: checkify.checkify, as for each buffer.
  step = jax.jit(checkify.checkify(lambda s, k: mix.sample(s, k, 4)))
  error, _ = step([states[0], online.clear(states[1])], jax.random.key(0))
  with pytest.raises(ValueError, match="empty"):
    error.throw()


# --- Composability: jit, vmap, scan, cond, no retrace, x64 ----------------------------


@pytest.mark.usefixtures("x64_mode")
def test_one_jitted_step_with_donation_traces_once():
  mix, states = two_parts()
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(states, key, new_items):
    states = [mix.buffers[0].add(states[0], new_items), states[1]]
    batch = mix.sample(states, key, 6)
    return mix.update_priorities(states, batch, batch.weights + 0.5), batch

  step = jax.jit(step, donate_argnums=0)
  for i in range(3):
    states, batch = step(states, jax.random.key(i), items(20 + i, 2))
  assert int(states[0].size) == 16 and batch.items["obs"].shape == (6, 3)
  # The bound functions from Python: no new trace after the first call.
  for i in range(3):
    mix.sample(states, jax.random.key(i), 6)
    states = mix.update_priorities(states, batch, jnp.ones(6))
    mix.can_sample(states, 6)
  assert mix.sample._cache_size() == 1
  assert mix.can_sample._cache_size() == 1


def test_vmap_over_seeds_of_states_and_keys():
  offline = jaxbuf.uniform_replay(8)
  online = jaxbuf.prioritized_replay(8)
  mix = jaxbuf.mixture([offline, online], [1, 3])
  num_seeds = 3

  def fresh(seed):
    base = seed.astype(jnp.float32)
    return [
      offline.add(
        offline.init(ITEM), {"obs": jnp.full((4, 3), base), "action": jnp.zeros(4, jnp.int32)}
      ),
      online.add(
        online.init(ITEM), {"obs": jnp.full((2, 3), -base), "action": jnp.ones(2, jnp.int32)}
      ),
    ]

  states = jax.jit(jax.vmap(fresh))(jnp.arange(num_seeds))
  keys = jax.random.split(jax.random.key(0), num_seeds)
  batch = jax.vmap(lambda s, k: mix.sample(s, k, 8))(states, keys)
  assert batch.items["obs"].shape == (num_seeds, 8, 3)
  np.testing.assert_array_equal(batch.source, np.tile([0, 0, 1, 1, 1, 1, 1, 1], (num_seeds, 1)))
  np.testing.assert_array_equal(batch.items["obs"][:, 0, 0], np.arange(3))
  np.testing.assert_array_equal(batch.items["obs"][:, -1, 0], -np.arange(3))
  states = jax.jit(jax.vmap(mix.update_priorities))(states, batch, jnp.ones((num_seeds, 8)))
  for seed in range(num_seeds):
    one = jax.tree.map(lambda x, seed=seed: x[seed], states)
    direct = mix.sample(one, keys[seed], 8)
    np.testing.assert_array_equal(direct.items["obs"], batch.items["obs"][seed])
  # 6 rows from a part of 2 items: drawn with replacement, so it can sample.
  assert np.asarray(jax.vmap(lambda s: mix.can_sample(s, 8))(states)).all()
  empty = jax.vmap(lambda s: [s[0], online.clear(s[1])])(states)
  assert not np.asarray(jax.vmap(lambda s: mix.can_sample(s, 8))(empty)).any()


@pytest.mark.usefixtures("x64_mode")
def test_scan_matches_a_python_loop():
  mix, states = two_parts()
  keys = jax.random.split(jax.random.key(6), 5)

  def body(states, key):
    batch = mix.sample(states, key, 4)
    return mix.update_priorities(states, batch, batch.items["obs"][:, 0] + 1.0), batch.source

  scanned, sources = jax.lax.scan(body, jax.tree.map(jnp.copy, states), keys)
  looped = states
  for key in keys:
    looped, _ = body(looped, key)
  chex.assert_trees_all_equal(snapshot(scanned), snapshot(looped))
  np.testing.assert_array_equal(sources, np.tile([0, 0, 1, 1], (5, 1)))


def test_every_function_runs_inside_lax_cond():
  mix, states = two_parts()

  @jax.jit
  def step(states, key, learn):
    batch = mix.sample(states, key, 4)
    ready = mix.can_sample(states, 4)
    return jax.lax.cond(
      learn & ready,
      lambda s: mix.update_priorities(s, batch, batch.weights + 2.0),
      lambda s: s,
      states,
    )

  learned = step(jax.tree.map(jnp.copy, states), jax.random.key(0), jnp.bool_(True))
  kept = step(jax.tree.map(jnp.copy, states), jax.random.key(0), jnp.bool_(False))
  chex.assert_trees_all_equal(snapshot(kept), snapshot(states))
  assert not np.array_equal(learned[1].sum_tree.levels[0], states[1].sum_tree.levels[0])


def test_step_folds_the_loop_counter_into_the_key():
  mix, states = two_parts()
  key = jax.random.key(5)
  chex.assert_trees_all_equal(
    mix.sample(states, key, 4, step=7), mix.sample(states, jax.random.fold_in(key, 7), 4)
  )


# --- Checkpoints -----------------------------------------------------------------------


def test_states_save_and_load_as_one_checkpoint(tmp_path):
  mix, states = two_parts()
  states[1] = mix.buffers[1].update_priorities(states[1], jnp.arange(4), jnp.arange(1.0, 5.0))
  path = os.fspath(tmp_path / "mixture")
  jaxbuf.save(path, states)
  like = [jax.eval_shape(buffer.init, ITEM) for buffer in mix.buffers]
  restored = jaxbuf.load(path, like=like)
  assert isinstance(restored, list)
  chex.assert_trees_all_equal(snapshot(restored), snapshot(states))
  chex.assert_trees_all_equal(
    mix.sample(restored, jax.random.key(0), 6), mix.sample(states, jax.random.key(0), 6)
  )


# --- Sharded parts ---------------------------------------------------------------------


@devices.needs(4)
@pytest.mark.parametrize("batch_layout", ["sharded", "replicated"])
def test_sharded_parts_sample_and_update_like_their_own_buffers(batch_layout):
  mesh = devices.mesh(4)
  online = jaxbuf.sharded(jaxbuf.prioritized_replay(32, alpha=1.0), mesh, batch=batch_layout)
  offline = jaxbuf.uniform_replay(16)
  mix = jaxbuf.mixture([offline, online], [1, 1])
  states = [
    offline.add(offline.init(ITEM), items(0, 10, 0)),
    online.add(online.init(ITEM), items(0, 12, 1)),
  ]
  key = jax.random.key(9)
  batch = mix.sample(states, key, 16)
  assert mix.rows(16) == (8, 8)
  direct = online.sample(states[1], jax.random.fold_in(key, 1), 8)
  chex.assert_trees_all_equal(
    jax.tree.map(np.asarray, batch.parts[1]), jax.tree.map(np.asarray, direct)
  )
  # Whole on the host: under Explicit axes JAX refuses to slice rows across
  # the split of a sharded batch (see jaxbuf.sharded).
  actions = np.asarray(batch.items["action"])
  np.testing.assert_array_equal(actions[8:], direct.items["action"])
  assert np.all(actions[8:] >= 1000) and np.all(actions[:8] < 1000)
  priorities = np.arange(1.0, 17.0, dtype=np.float32)
  expected = snapshot(
    online.update_priorities(
      jax.tree.map(jnp.copy, states[1]), direct.indices, priorities[8:], direct.item_ids
    )
  )
  states = mix.update_priorities(states, batch, priorities)
  chex.assert_trees_all_equal(snapshot(states[1]), expected)
  assert bool(mix.can_sample(states, 16))
  # A share that does not divide by the part's devices: named.
  with pytest.raises(
    ValueError,
    match=r"part 1 \(sharded prioritized_replay\) "
    r"gets 3 of the 6 rows.*4 devices",
  ):
    mix.sample(states, key, 6)
  with pytest.raises(ValueError, match="part 1"):
    mix.can_sample(states, 6)


# --- Reliability round 5 (issue 45) ----------------------------------------------------


@devices.needs(4)
@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_a_sharded_part_keeps_working_after_priority_updates(count, axis_type):
  """Row `mixture-sharded-part-update`: on a mesh made as the sharding guide
  makes it, the first update returned the unsharded part's state replicated
  over the mesh, and the next sample raised JAX's ShardingTypeError. Each
  part's state stays where its own buffer keeps it, over several rounds."""
  types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  mesh = devices.mesh(count, axis_types=(types[axis_type],))
  online = jaxbuf.sharded(jaxbuf.prioritized_replay(8 * count, alpha=1.0), mesh)
  offline = jaxbuf.prioritized_replay(16)
  mix = jaxbuf.mixture([offline, online], [1, 1])
  states = [
    offline.add(offline.init(ITEM), items(0, 10, 0)),
    online.add(online.init(ITEM), items(0, 4 * count, 1)),
  ]
  before = [jax.tree.map(lambda leaf: leaf.sharding, state) for state in states]
  batch = mix.sample(states, jax.random.key(0), 4 * count)
  states = mix.update_priorities(states, batch, np.arange(1.0, 4 * count + 1, dtype=np.float32))
  assert [jax.tree.map(lambda leaf: leaf.sharding, state) for state in states] == before
  mix.sample(states, jax.random.key(1), 4 * count)


def test_priorities_as_a_python_list_are_taken():
  """Row `mixture-priorities-list`: a raw TracerArrayConversionError; the
  buffer's own update_priorities takes a list, and so does the mixture's."""
  mix, states = two_parts()
  batch = mix.sample(states, jax.random.key(0), 6)
  from_list = mix.update_priorities(
    jax.tree.map(jnp.copy, states), batch, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  )
  from_array = mix.update_priorities(states, batch, jnp.arange(1.0, 7.0))
  chex.assert_trees_all_equal(snapshot(from_list), snapshot(from_array))


def test_one_state_given_for_two_parts_is_updated_by_both():
  """Row `mixture-same-state-twice`: `[s, s]` made XLA donate one buffer
  twice ("Attempt to donate the same buffer twice"). Drawing one dataset
  twice is allowed: the state is updated by each part in turn, and the
  state returned for both parts is the one result."""
  buffer = jaxbuf.prioritized_replay(16, alpha=1.0)
  state = buffer.add(buffer.init(ITEM), items(0, 10))
  mix = jaxbuf.mixture([buffer, buffer], [1, 1])
  batch = mix.sample([state, state], jax.random.key(0), 4)
  priorities = np.arange(1.0, 5.0, dtype=np.float32)
  expected = buffer.update_priorities(
    jax.tree.map(jnp.copy, state), batch.parts[0].indices, priorities[:2], batch.parts[0].item_ids
  )
  expected = buffer.update_priorities(
    expected, batch.parts[1].indices, priorities[2:], batch.parts[1].item_ids
  )
  updated = mix.update_priorities([state, state], batch, priorities)
  assert updated[0] is updated[1]
  chex.assert_trees_all_equal(snapshot(updated[0]), snapshot(expected))
  mix.sample(updated, jax.random.key(1), 4)


def test_proportions_are_normalised_exactly_and_strings_refused():
  """Row `mixture-proportions-overflow`: [1e308, 1e308] normalised to
  (0.0, 0.0) (the float sum overflowed) while rows() was right; strings such
  as "0.5" were read as numbers."""
  halves = jaxbuf.mixture([jaxbuf.uniform_replay(8)] * 2, [1e308, 1e308])
  assert halves.proportions == (0.5, 0.5)
  assert halves.rows(4) == (2, 2)
  with pytest.raises(TypeError, match=r"proportions\[0\] must be a real number, given str '0.5'"):
    jaxbuf.mixture([jaxbuf.uniform_replay(8)] * 2, ["0.5", "0.5"])


def test_a_mixed_batch_of_windows_has_their_mask_and_lengths():
  """Row `mixture-mask-lengths`: a mixed batch of sequence or episode parts
  had only `parts[k].mask`; its `mask` and `lengths` are the parts' own,
  concatenated in row order (True on every step, and L, for a part that
  has none), so a loss written from the batch's fields reads no padding."""
  step = {"obs": jnp.float32(0), "last": jnp.bool_(False)}
  windows = jaxbuf.sequence_replay(1, 16, 4, episodes="within")
  episodes = jaxbuf.episode_replay(1, 16, 4)
  ends = np.array([[False, True, False, False, False, True]])
  chunk = {"obs": jnp.arange(6, dtype=jnp.float32)[None], "last": jnp.asarray(ends)}
  states = [windows.add(windows.init(step), chunk), episodes.add(episodes.init(step), chunk)]
  mix = jaxbuf.mixture([windows, episodes], [1, 1])
  batch = mix.sample(states, jax.random.key(0), 8)
  np.testing.assert_array_equal(
    batch.mask, np.concatenate([batch.parts[0].mask, batch.parts[1].mask])
  )
  np.testing.assert_array_equal(batch.lengths[4:], batch.parts[1].lengths)
  np.testing.assert_array_equal(batch.lengths[:4], 4)
  assert not batch.mask[4:].all()  # episodes of 2 and 4 steps, padded to 4
  # Item parts have neither.
  mix, states = two_parts()
  batch = mix.sample(states, jax.random.key(0), 6)
  assert batch.mask is None and batch.lengths is None
