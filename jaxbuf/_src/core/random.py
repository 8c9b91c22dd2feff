"""Random numbers for sampling: `jax.random`'s bits, drawn faster on CPU.

Why this module exists beside `jax.random`, trick by trick:

- The Threefry copy (`threefry_2x32`, `random_bits`). On CPU, JAX lowers its
  Threefry-2x32 hash to a `while` loop of five rounds (to keep compile times
  short), and each round runs as a dozen small kernels: about 4 us per call,
  measured alone. The same 20 rounds written out here fuse into one
  elementwise kernel (about 0.5 us). On GPU and TPU, JAX unrolls them too, so
  there it buys nothing and costs nothing: the bits are the same.
- `computed_once` (CPU only). Being elementwise, the hash can be fused into
  whatever consumes the bits and recomputed per consumer element; on CPU a
  sample's gather redid it for every element of every row (40 us instead of
  30 at C = 1M). On other platforms it runs the computation plainly.
- Exact index arithmetic (`scale_to_span`, `permutation`), on every platform:
  64 random bits per uniform index, where `jax.random.randint` reduces 32
  bits modulo the size and is biased past 2**16 items.

Keys of the default Threefry implementation (typed or legacy uint32[2]) get
exactly the bits `jax.random.bits` gives, under JAX's default partitionable
Threefry counters; other key kinds (`rbg`, say) and the legacy counter layout
go to `jax.random` unchanged.

The off switch: with the environment variable `JAXBUF_PLAIN_RANDOM=1`, read
while tracing, the bits come from `jax.random.bits` and `computed_once` runs
its computation plainly. Results are identical (the same bits); only speed
changes. It is there to rule this module out when something looks wrong.
"""

import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
  return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry_2x32(
  key_words: tuple[jax.Array, jax.Array], counts: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """The Threefry-2x32 hash (20 rounds) of counter pairs, elementwise.

  Args:
    key_words: two uint32 scalars.
    counts: two uint32 arrays of one shape, the high and low counter words.

  Returns:
    Two uint32 arrays of that shape.
  """
  schedule = (key_words[0], key_words[1], key_words[0] ^ key_words[1] ^ _KEY_PARITY)
  x0 = counts[0] + schedule[0]
  x1 = counts[1] + schedule[1]
  for block in range(5):
    for distance in _ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, distance) ^ x0
    x0 = x0 + schedule[(block + 1) % 3]
    x1 = x1 + schedule[(block + 2) % 3] + np.uint32(block + 1)
  return x0, x1


def plain_random() -> bool:
  """Whether `JAXBUF_PLAIN_RANDOM=1` turns the tricks off (read at trace time)."""
  return os.environ.get("JAXBUF_PLAIN_RANDOM", "0") not in ("", "0")


def _threefry_key_words(key: jax.Array) -> tuple[jax.Array, jax.Array] | None:
  """The two key words, or None where `jax.random` must draw the bits."""
  config: Any = jax.config  # its options are attributes it makes at runtime
  if not config.jax_threefry_partitionable or plain_random():
    return None
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != () or str(jax.random.key_impl(key)) != "threefry2x32":
      return None
    key = jax.random.key_data(key)
  elif (
    str(config.jax_default_prng_impl) != "threefry2x32"
    or key.shape != (2,)
    or key.dtype != jnp.uint32
    or config.jax_legacy_prng_key != "allow"
  ):
    return None  # jax.random decides what such a key means, warns or rejects
  return key[0], key[1]


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`jax.random.bits(key, shape, jnp.uint32)` for one key: uint32 `shape`."""
  key_words = _threefry_key_words(key)
  size = math.prod(shape)
  if key_words is None or size >= 2**32:
    return jax.random.bits(key, shape, jnp.uint32)
  # JAX counts the elements with a 64-bit index split into two words; below
  # 2**32 elements the high word is zero.
  low = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
  x0, x1 = threefry_2x32(key_words, (jnp.zeros_like(low), low))
  return x0 ^ x1


def fold_in(key: jax.Array, data: jax.typing.ArrayLike) -> jax.Array:
  """`jax.random.fold_in(key, data)`, the same key, hashed unrolled.

  `data` is an integer scalar, read as uint32 as `jax.random.fold_in` reads
  it. On CPU JAX's fold-in is the looped Threefry (see the module notes):
  measured in a Python loop it tripled a sample's cost (50 to 190 us a call
  on a loaded 2-core machine).
  """
  key_words = _threefry_key_words(key)
  if key_words is None:
    return jax.random.fold_in(key, data)
  # JAX hashes the counter pair (high, low) of `data`: (0, data) for 32 bits.
  low = jnp.asarray(data).astype(jnp.uint32)
  new_words = jnp.stack(threefry_2x32(key_words, (jnp.zeros_like(low), low)))
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(new_words, impl=jax.random.key_impl(key))
  return new_words


def random_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`jax.random.uniform(key, shape, jnp.float32)`: float32 `shape` in `[0, 1)`."""
  return uniform_from_bits(random_bits(key, shape))


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """uint32 random bits as float32 uniforms in `[0, 1)`, as `jax.random.uniform`."""
  # The top 23 bits as the mantissa of a float in [1, 2), minus one.
  one_to_two = jax.lax.bitcast_convert_type(
    (bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32
  )
  return one_to_two - 1.0


def computed_once(compute: Callable[[], jax.Array], never_negative: jax.Array) -> jax.Array:
  """`compute()`, kept in a buffer of its own on CPU rather than fused.

  XLA fuses cheap elementwise producers into their consumers and recomputes
  them for every element the consumer produces. For gather indices that is
  every element of every gathered row: a uniform sample of 256 items of 84
  floats redid the random hash and three integer remainders 84 times per row,
  and took 40 us instead of 30 at C = 1M. An optimization barrier is removed
  before fusion on CPU; a `while` loop whose trip count XLA cannot know (1 at
  run time, since `never_negative >= 0`) is not. Other platforms run
  `compute()` plainly: there a data-dependent loop would cost a device-to-
  host copy of its predicate. So does `JAXBUF_PLAIN_RANDOM=1`.
  """
  if plain_random():
    return compute()

  def in_a_loop():
    trips = 1 + (never_negative < 0).astype(jnp.int32)  # 1, but not to XLA
    # Zeros typed like the result (under shard_map, varying like it too), so
    # the loop's carry keeps one type. Starting from `compute()` itself would
    # let XLA see the result as loop-invariant and fuse it again.
    placeholder = jax.tree.map(jnp.zeros_like, compute())
    return jax.lax.while_loop(
      lambda carry: carry[0] < trips,
      lambda carry: (carry[0] + 1, compute()),
      (jnp.int32(0), placeholder),
    )[1]

  return jax.lax.platform_dependent(cpu=in_a_loop, default=compute)


def multiply_high(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The full 64-bit product of uint32 arrays: its high and low uint32 words.

  In 16-bit halves, so that no partial product overflows 32 bits, whatever
  the 64-bit mode (`lax.mul` of uint32 keeps only the low word).
  """
  mask = np.uint32(0xFFFF)
  a_low, a_high = a & mask, a >> np.uint32(16)
  b_low, b_high = b & mask, b >> np.uint32(16)
  low_low = a_low * b_low
  middle = a_high * b_low + (low_low >> np.uint32(16))  # < 2**32
  other_middle = a_low * b_high + (middle & mask)  # < 2**32
  high = a_high * b_high + (middle >> np.uint32(16)) + (other_middle >> np.uint32(16))
  return high, a * b


def scale_to_span(higher_bits: jax.Array, lower_bits: jax.Array, span: jax.Array) -> jax.Array:
  """`floor(r * span / 2**64)` for the 64-bit `r = higher_bits * 2**32 + lower_bits`.

  Multiply-shift reduction (Lemire's, without rejection): each of the `span`
  results receives `floor(2**64 / span)` or one more of the 2**64 values of
  `r`, so with uniform bits every result has probability `1 / span` to
  within `2**-64`, for every `span` in `[1, 2**32)`. (Reducing 32-bit words
  modulo `span`, as `jax.random.randint` does, overflows for spans past 2**16
  and favoured the first third of 3 * 2**28 items, 37.5% against 33.3%.)

  Args:
    higher_bits, lower_bits: uint32 `[S]`, the two words of `r`.
    span: uint32 scalar, at least 1.

  Returns:
    uint32 `[S]` in `[0, span)`.
  """
  # r * span = higher * span * 2**32 + lower * span; only the carry of the
  # second term into the top word matters.
  high_of_high, low_of_high = multiply_high(higher_bits, span)
  carry_source, _ = multiply_high(lower_bits, span)
  low_word = low_of_high + carry_source
  carry = (low_word < low_of_high).astype(jnp.uint32)
  return high_of_high + carry


def uniform_indices(key: jax.Array, size: jax.Array, batch_size: int) -> jax.Array:
  """Slots drawn uniformly from the `size` items held (slot 0 when empty).

  64 random bits per draw, scaled to `[0, size)` by `scale_to_span`: exact
  to within 2**-64 per slot at every capacity, with all the bits from one
  unrolled call to the generator (`random_bits`) instead of a split and two
  calls, each of them a loop of small kernels on CPU. Computed once
  (`computed_once`), not inside each gather that uses them.
  """

  def draw():
    higher_bits, lower_bits = random_bits(key, (2, batch_size))
    span = jnp.maximum(size, 1).astype(jnp.uint32)
    return scale_to_span(higher_bits, lower_bits, span).astype(jnp.int32)

  return computed_once(draw, size)


# `short_permutation` packs each index into the low bits of its random sort
# key, so that one sort of a single uint32 array orders them: on CPU, 4 us
# for 256 indices, where a sort of keys and indices as two arrays (argsort)
# took 24. Below 2**12 indices, at least 20 random bits remain per key.
SHORT_PERMUTATION_MAX = 2**12


def short_permutation(bits: jax.Array) -> jax.Array:
  """A uniformly random order of `range(n)` from uint32 random bits `[n]`.

  Indices are sorted by their random bits with the low `ceil(log2 n)` bits
  replaced by the index itself: one sort of one uint32 array. Two indices
  whose remaining bits tie (probability `2**-(32 - ceil(log2 n))` per pair,
  below `2**-20`) keep their positional order. Past `SHORT_PERMUTATION_MAX`
  indices that bias would grow, so the order comes from sorting by all 32
  bits with the index as a second operand instead (slower on CPU, exact to
  the same ties as `permutation`'s 32-bit half).

  Returns:
    int32 `[n]`, a permutation of `range(n)`.
  """
  num_items = bits.shape[0]
  positions = lax.iota(jnp.uint32, num_items)
  if num_items > SHORT_PERMUTATION_MAX:
    return lax.sort((bits, positions), num_keys=1)[1].astype(jnp.int32)
  index_mask = np.uint32((1 << max(1, (num_items - 1).bit_length())) - 1)
  packed = (bits & ~index_mask) | positions
  return (lax.sort(packed) & index_mask).astype(jnp.int32)


def rank_keys(bits: jax.Array) -> jax.Array:
  """The position of each index in `short_permutation(bits)`'s order: int32
  `[n]`, itself a uniformly random permutation of `range(n)`.

  Lane i's rank is the number of keys below its own, the keys packed with
  their index as `short_permutation` packs them (so no two tie): what a
  GPU kernel counts lane against lane (`sum_tree_kernels.draw`), computed
  here as the inverse of the sorted order, the same integers.
  """
  num_items = bits.shape[0]
  order = short_permutation(bits)
  return (
    jnp.zeros(num_items, jnp.int32)
    .at[order]
    .set(lax.iota(jnp.int32, num_items), unique_indices=True)
  )


def permutation(key: jax.Array, num_items: int) -> jax.Array:
  """A uniformly random permutation of `range(num_items)`, int32 `[num_items]`.

  One sort of the indices by 64 random bits each. `jax.random.permutation`
  sorts by 32 bits in as many rounds as it needs for exactness (two for a
  rollout of 512K steps); on CPU the sort dominates a PPO epoch's data work,
  and a single 64-bit sort halves it. Ties, which would order two indices
  by position, have probability below `num_items**2 / 2**65` (1e-8 at 512K).

  >>> import jax
  >>> from jaxbuf._src.core import random
  >>> sorted(random.permutation(jax.random.key(0), 5).tolist())
  [0, 1, 2, 3, 4]
  """
  high_bits, low_bits = random_bits(key, (2, num_items))
  return lax.sort((high_bits, low_bits, lax.iota(jnp.int32, num_items)), num_keys=2)[2]


def permutation_of_first(key: jax.Array, num_slots: int, count: jax.Array) -> jax.Array:
  """Slots `0..count-1` in a uniformly random order, then the rest.

  `count` may be traced (the items held); the shape is `num_slots`, static.
  One sort by (slot not counted, 64 random bits), as `permutation`.

  Returns:
    int32 `[num_slots]`: a permutation of `range(num_slots)` whose first
    `count` entries are a uniformly random order of `range(count)`.

  >>> import jax, jax.numpy as jnp
  >>> from jaxbuf._src.core import random
  >>> order = random.permutation_of_first(jax.random.key(0), 6, jnp.int32(4))
  >>> sorted(order[:4].tolist()), sorted(order[4:].tolist())
  ([0, 1, 2, 3], [4, 5])
  """
  high_bits, low_bits = random_bits(key, (2, num_slots))
  slots = lax.iota(jnp.int32, num_slots)
  not_counted = (slots >= count).astype(jnp.uint32)
  return lax.sort((not_counted, high_bits, low_bits, slots), num_keys=3)[3]
