"""The unrolled Threefry draws equal `jax.random`'s, bit for bit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxbuf
from jaxbuf._src.core import random as jaxbuf_random

KEYS = {
  "typed": lambda: jax.random.key(3),
  "legacy uint32[2]": lambda: jax.random.PRNGKey(7),
  "folded": lambda: jax.random.fold_in(jax.random.key(1), 12345),
  "split": lambda: jax.random.split(jax.random.key(2))[1],
  "rbg (delegated)": lambda: jax.random.key(4, impl="rbg"),
}
SHAPES = [(1,), (5,), (2, 256), (3, 4, 5)]


@pytest.mark.parametrize("key_name", KEYS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bits_and_uniform_equal_jax_random(key_name, shape):
  key = KEYS[key_name]()
  np.testing.assert_array_equal(
    jaxbuf_random.random_bits(key, shape), jax.random.bits(key, shape, jnp.uint32)
  )
  np.testing.assert_array_equal(
    jaxbuf_random.random_uniform(key, shape), jax.random.uniform(key, shape, jnp.float32)
  )


def test_equal_under_jit_and_vmap_over_keys():
  keys = jax.random.split(jax.random.key(0), 16)
  ours = jax.jit(jax.vmap(lambda key: jaxbuf_random.random_uniform(key, (64,))))(keys)
  theirs = jax.vmap(lambda key: jax.random.uniform(key, (64,), jnp.float32))(keys)
  np.testing.assert_array_equal(ours, theirs)


def test_legacy_counter_layout_is_delegated():
  key = jax.random.key(5)
  with jax.threefry_partitionable(False):
    np.testing.assert_array_equal(
      jaxbuf_random.random_bits(key, (300,)), jax.random.bits(key, (300,), jnp.uint32)
    )


def test_lowers_to_straight_line_code_on_every_backend():
  """No loop: JAX's own CPU lowering of the hash is a five-step while."""
  text = (
    jax.jit(lambda key: jaxbuf_random.random_bits(key, (256,)))
    .trace(jax.random.key(0))
    .lower(lowering_platforms=("cpu", "cuda", "tpu"))
    .as_text()
  )
  assert "while" not in text


def test_legacy_keys_follow_jax_legacy_prng_key_setting():
  with jax.legacy_prng_key("error"):
    with pytest.raises(ValueError, match="legacy"):
      jaxbuf_random.random_bits(jax.random.PRNGKey(0), (4,))


def test_keys_that_are_not_one_threefry_key_get_jax_randoms_answer():
  batch_of_keys = jax.random.split(jax.random.key(0), 3)
  with pytest.raises(Exception) as ours:
    jaxbuf_random.random_bits(batch_of_keys, (4,))
  with pytest.raises(Exception) as theirs:
    jax.random.bits(batch_of_keys, (4,), jnp.uint32)
  assert type(ours.value) is type(theirs.value)


WORDS = [0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 0x9E3779B9, 0x7F4A7C15]
SPANS = [1, 2, 3, 7, 2**16 - 1, 2**16 + 1, 3 * 2**20, 3 * 2**28, 2**30 - 1, 2**31 + 11, 2**32 - 1]


def test_multiply_high_is_the_full_64_bit_product():
  a, b = np.meshgrid(np.array(WORDS, np.uint64), np.array(WORDS + SPANS, np.uint64))
  high, low = jaxbuf_random.multiply_high(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
  products = [int(x) * int(y) for x, y in zip(a.ravel(), b.ravel())]
  assert np.asarray(high).ravel().tolist() == [p >> 32 for p in products]
  assert np.asarray(low).ravel().tolist() == [p % 2**32 for p in products]


def test_scale_to_span_is_multiply_shift_of_64_bits_in_python_integers():
  high, low, span = (
    np.array(x, np.uint64).ravel() for x in np.meshgrid(WORDS, WORDS, SPANS, indexing="ij")
  )
  ours = jaxbuf_random.scale_to_span(
    jnp.asarray(high, jnp.uint32), jnp.asarray(low, jnp.uint32), jnp.asarray(span, jnp.uint32)
  )
  expected = [((int(h) << 32 | int(l)) * int(s)) >> 64 for h, l, s in zip(high, low, span)]
  assert np.asarray(ours).tolist() == expected
  assert np.all(np.asarray(ours) < span)


@pytest.mark.parametrize("size", [3 * 2**28, 2**30 - 1, 3 * 2**20 + 1])
def test_uniform_indices_are_uniform_at_the_largest_sizes(size):
  """No storage: the index function alone, at sizes no test could fill.

  Reducing 32 bits modulo 3 * 2**28 gave the first third 37.5% of draws; here
  the first third must get 1/3 (binomial p > 1e-3), 64 equal bins chi-square
  p > 1e-3, and the low bits of the index are uniform too.
  """
  draw = jax.jit(lambda key: jaxbuf_random.uniform_indices(key, jnp.int32(size), 2**15))
  indices = np.concatenate(
    [np.asarray(draw(key)) for key in jax.random.split(jax.random.key(11), 8)]
  ).astype(np.int64)
  assert indices.min() >= 0 and indices.max() < size
  first_third = int(np.sum(indices < size / 3))
  assert scipy.stats.binomtest(first_third, indices.size, 1 / 3).pvalue > 1e-3
  bins = np.bincount(indices * 64 // size, minlength=64)
  assert scipy.stats.chisquare(bins).pvalue > 1e-3
  assert scipy.stats.chisquare(np.bincount(indices % 16, minlength=16)).pvalue > 1e-3


def _every_draw(key):
  return (
    jaxbuf_random.random_bits(key, (2, 5)),
    jaxbuf_random.random_uniform(key, (7,)),
    jaxbuf_random.uniform_indices(key, jnp.int32(1000), 64),
    jaxbuf_random.permutation(key, 50),
    jaxbuf_random.permutation_of_first(key, 10, jnp.int32(6)),
  )


def test_plain_random_switch_gives_identical_results(monkeypatch):
  """JAXBUF_PLAIN_RANDOM=1 (read while tracing): jax.random draws the bits,
  computed_once runs plainly, and every result is the same, down to whole
  buffer samples and epochs."""
  key = jax.random.key(21)
  items = jnp.arange(40, dtype=jnp.int32)

  def sampled(make):
    buffer = make(64)  # a new buffer: its jitted functions trace afresh
    state = buffer.add(buffer.init(jnp.int32(0)), items)
    return (buffer.sample(state, key, 32).indices, jaxbuf.epoch_batches(state, key, 16).indices)

  makers = (jaxbuf.uniform_replay, jaxbuf.prioritized_replay)
  jaxpr_with_tricks = str(jax.make_jaxpr(_every_draw)(key))
  with_tricks = (jax.jit(_every_draw)(key), [sampled(m) for m in makers])
  monkeypatch.setenv("JAXBUF_PLAIN_RANDOM", "1")
  assert jaxbuf_random.plain_random()
  jaxpr_plain = str(jax.make_jaxpr(lambda k: _every_draw(k))(key))  # uncached
  plain = (jax.jit(lambda k: _every_draw(k))(key), [sampled(m) for m in makers])
  chex.assert_trees_all_equal(with_tricks, plain)
  # Which code ran: JAX's own random_bits only when plain; the CPU-only
  # computed_once (a platform_index switch) only with the tricks.
  assert "random_bits[" in jaxpr_plain and "platform_index" not in jaxpr_plain
  assert "random_bits[" not in jaxpr_with_tricks
  assert "platform_index" in jaxpr_with_tricks
  monkeypatch.setenv("JAXBUF_PLAIN_RANDOM", "0")
  assert not jaxbuf_random.plain_random()


def test_permutation_of_first_orders_the_counted_slots_uniformly():
  """Where slot 0 lands among the first 5 of 9, over 1000 keys: uniform
  (chi-square p > 1e-3); the uncounted slots follow, in any order."""
  orders = np.asarray(
    jax.jit(jax.vmap(lambda k: jaxbuf_random.permutation_of_first(k, 9, jnp.int32(5))))(
      jax.random.split(jax.random.key(22), 1000)
    )
  )
  assert all(sorted(row[:5]) == list(range(5)) for row in orders.tolist())
  assert all(sorted(row[5:]) == list(range(5, 9)) for row in orders.tolist())
  counts = np.bincount(np.argmax(orders == 0, axis=1), minlength=5)
  assert scipy.stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("num_items", [1, 2, 7, 256, jaxbuf_random.SHORT_PERMUTATION_MAX + 3])
def test_short_permutation_is_a_permutation(num_items):
  """Packed keys (and, past the packing limit, keys with indices beside them)
  give every index once, at every size."""
  bits = jaxbuf_random.random_bits(jax.random.key(num_items), (num_items,))
  order = np.asarray(jax.jit(jaxbuf_random.short_permutation)(bits))
  assert order.dtype == np.int32
  assert sorted(order.tolist()) == list(range(num_items))


def test_short_permutation_draws_every_order_of_four_equally_often():
  """All 24 orders of 4 indices over 12,000 keys: uniform (chi-square p >
  1e-3); and where index 0 lands among 256, over 2,000 keys, uniform too."""

  def orders(num_items, num_keys, seed):
    keys = jax.random.split(jax.random.key(seed), num_keys)
    return np.asarray(
      jax.jit(
        jax.vmap(
          lambda k: jaxbuf_random.short_permutation(jaxbuf_random.random_bits(k, (num_items,)))
        )
      )(keys)
    )

  small = orders(4, 12_000, 31)
  codes = small @ np.array([64, 16, 4, 1])
  counts = np.unique(codes, return_counts=True)[1]
  assert counts.shape == (24,)
  assert scipy.stats.chisquare(counts).pvalue > 1e-3
  large = orders(256, 2_000, 32)
  where_zero = np.argmax(large == 0, axis=1)
  assert scipy.stats.chisquare(np.bincount(where_zero // 16, minlength=16)).pvalue > 1e-3
