"""The unrolled Threefry draws equal `jax.random`'s, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbuf._src import random as jaxbuf_random

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
  np.testing.assert_array_equal(jaxbuf_random.random_bits(key, shape),
                                jax.random.bits(key, shape, jnp.uint32))
  np.testing.assert_array_equal(jaxbuf_random.random_uniform(key, shape),
                                jax.random.uniform(key, shape, jnp.float32))


def test_equal_under_jit_and_vmap_over_keys():
  keys = jax.random.split(jax.random.key(0), 16)
  ours = jax.jit(jax.vmap(lambda key: jaxbuf_random.random_uniform(key, (64,))))(keys)
  theirs = jax.vmap(lambda key: jax.random.uniform(key, (64,), jnp.float32))(keys)
  np.testing.assert_array_equal(ours, theirs)


def test_legacy_counter_layout_is_delegated():
  key = jax.random.key(5)
  with jax.threefry_partitionable(False):
    np.testing.assert_array_equal(jaxbuf_random.random_bits(key, (300,)),
                                  jax.random.bits(key, (300,), jnp.uint32))


def test_lowers_to_straight_line_code_on_every_backend():
  """No loop: JAX's own CPU lowering of the hash is a five-step while."""
  text = jax.jit(lambda key: jaxbuf_random.random_bits(key, (256,))).trace(
      jax.random.key(0)).lower(
          lowering_platforms=("cpu", "cuda", "tpu")).as_text()
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
