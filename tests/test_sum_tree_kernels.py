"""The sum tree's kernels: the Pallas kernels (`sum_tree_kernels.py`, run here
in Pallas's interpret mode) against their XLA twins, bit for bit; the
variable that forces a variant; the compile target that chooses them; and
their Triton lowering for a GPU, checked on the CPU (lowering needs no GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from jaxbuf._src.core import sum_tree_kernels
from jaxbuf._src.core import sum_tree


def _descents(monkeypatch, variant, function, *args):
  """`function(*args)` jitted afresh under `variant` (read while tracing)."""
  monkeypatch.setenv(sum_tree.KERNEL_VARIANT_VARIABLE, variant)
  return jax.jit(function)(*args)


def _tree(num_leaves: int, seed: int) -> tuple[np.ndarray, sum_tree.SumTree]:
  rng = np.random.default_rng(seed)
  leaves = rng.exponential(size=num_leaves).astype(np.float32) * (rng.random(num_leaves) > 0.3)
  return leaves, sum_tree.from_leaves(jnp.asarray(leaves))


@pytest.mark.parametrize(
  "num_leaves, batch_size, stratified",
  [
    (5, 3, True),  # one level below the root
    (5000, 256, True),  # five levels: one redraw, two blocks of targets
    (600, 100, False),  # three levels, a batch padded to a power of two
  ],
)
def test_pallas_descent_returns_the_xla_leaves_bit_for_bit(
  monkeypatch, num_leaves, batch_size, stratified
):
  leaves, tree = _tree(num_leaves, seed=num_leaves)
  draw = lambda tree, key: sum_tree.sample_leaves(tree, key, batch_size, stratified=stratified)
  key = jax.random.key(num_leaves)
  xla = _descents(monkeypatch, "xla", draw, tree, key)
  pallas = _descents(monkeypatch, "pallas", draw, tree, key)
  np.testing.assert_array_equal(pallas[0], xla[0])
  np.testing.assert_array_equal(pallas[1], xla[1])
  assert np.all(leaves[np.asarray(pallas[0])] > 0)  # never a zero leaf
  assert pallas[0].dtype == jnp.int32 and pallas[1].dtype == jnp.float32


def test_pallas_descent_at_and_past_the_total_and_of_an_empty_tree(monkeypatch):
  # Targets past the total through rounding take the last positive leaf;
  # an empty tree gives leaf 0, as the XLA descent does.
  leaves, tree = _tree(600, seed=1)
  total = sum_tree.total(tree)
  targets = jnp.stack([total, total * 1.5, jnp.float32(0), total * 0.5])
  redraws = jnp.full((sum_tree.num_redraws(tree), 4), 0.999, jnp.float32)
  find = sum_tree.find_prefix_sums_and_leaves
  for candidate in (tree, sum_tree.init(600)):
    xla = _descents(monkeypatch, "xla", find, candidate, targets, redraws)
    pallas = _descents(monkeypatch, "pallas", find, candidate, targets, redraws)
    np.testing.assert_array_equal(pallas[0], xla[0])
    np.testing.assert_array_equal(pallas[1], xla[1])


@pytest.mark.parametrize("unique_indices", [True, False])
def test_pallas_writes_give_the_xla_tree_bit_for_bit(monkeypatch, unique_indices):
  # 40,000 leaves: the lowest levels are written node by node, the upper
  # ones summed whole on the XLA path; duplicates resolved by their last
  # valid occurrence, skipped writes leave their leaf.
  _, tree = _tree(40_000, seed=2)
  rng = np.random.default_rng(3)
  if unique_indices:
    indices = rng.permutation(40_000)[:300]
  else:
    indices = rng.integers(0, 500, 300)
  values = rng.uniform(0, 5, 300).astype(np.float32)
  valid = rng.random(300) < 0.8
  # Leaf 0 written once among skipped writes to it and to indices out of
  # bounds: a skipped write must never undo a valid one.
  indices[:4], valid[:4] = [0, 0, 10**6, 0], [False, True, False, False]
  write = lambda tree, indices, values, valid: sum_tree.set_leaves(
    tree, indices, values, valid, unique_indices=unique_indices
  )
  arguments = (tree, jnp.asarray(indices, jnp.int32), jnp.asarray(values), jnp.asarray(valid))
  xla = _descents(monkeypatch, "xla", write, *arguments)
  pallas = _descents(monkeypatch, "pallas", write, *arguments)
  for got, expected in zip(pallas.levels, xla.levels, strict=True):
    np.testing.assert_array_equal(got, expected)
  # Vmapped, the interpreter orders a batch's stores otherwise.
  twice = jax.tree.map(lambda leaf: jnp.stack([leaf, leaf]), arguments)
  pallas = _descents(monkeypatch, "pallas", jax.vmap(write), *twice)
  for got, expected in zip(pallas.levels, xla.levels, strict=True):
    np.testing.assert_array_equal(got[1], expected)
  nothing = (arguments[0], arguments[1], arguments[2], jnp.zeros(300, bool))
  unchanged = _descents(monkeypatch, "pallas", write, *nothing)
  for got, expected in zip(unchanged.levels, tree.levels, strict=True):
    np.testing.assert_array_equal(got, expected)


def test_prioritized_replay_is_the_same_under_the_pallas_kernels_also_vmapped(monkeypatch):
  buffer = jaxbuf.prioritized_replay(300)
  state = buffer.init({"obs": jnp.zeros(2, jnp.float32)})
  state = buffer.add(state, {"obs": jnp.arange(400, dtype=jnp.float32).reshape(200, 2)})
  states = jax.tree.map(lambda leaf: jnp.stack([leaf, leaf + 1]), state)
  keys = jax.random.split(jax.random.key(3), 2)

  def step(state, key):
    state = buffer.add(state, {"obs": jnp.ones((100, 2), jnp.float32)})
    state = buffer.update_priorities(
      state, jnp.arange(0, 250, 3), jnp.linspace(0.1, 9.0, 84, dtype=jnp.float32)
    )
    return state, buffer.sample(state, key, 32)

  # "pallas" covers both kernels; "pallas_descent" is the descent alone.
  xla = _descents(monkeypatch, "xla", jax.vmap(step), states, keys)
  pallas = _descents(monkeypatch, "pallas", jax.vmap(step), states, keys)
  for leaf, expected in zip(jax.tree.leaves(pallas), jax.tree.leaves(xla), strict=True):
    np.testing.assert_array_equal(leaf, expected)


@pytest.mark.parametrize(
  "num_leaves, batch_size, stratified, fallback_size",
  [
    (5000, 256, True, 7),  # five levels, a redraw; ranks over 8 chunks
    (600, 100, False, 0),  # three levels, a batch padded to a power of two
    (40_000, 37, True, 3),  # a batch below one rank chunk
    (8, 1, True, 1),  # one level below the root, one draw
  ],
)
def test_the_draw_kernel_gives_the_xla_draw_bit_for_bit(
  monkeypatch, num_leaves, batch_size, stratified, fallback_size
):
  # One kernel for the targets (strata ranked in it), the descent, the
  # fallback and the smallest value, against `sum_tree._draw_levels`.
  leaves, tree = _tree(num_leaves, seed=batch_size)
  draw = lambda tree, key, size: sum_tree.draw_leaves(
    tree, key, batch_size, stratified=stratified, fallback_size=size
  )
  for candidate in (tree, sum_tree.init(num_leaves)):  # the second: the fallback
    for seed in range(3):
      arguments = (candidate, jax.random.key(seed), jnp.int32(fallback_size))
      xla = _descents(monkeypatch, "xla", draw, *arguments)
      pallas = _descents(monkeypatch, "pallas", draw, *arguments)
      for got, expected in zip(pallas, xla, strict=True):
        np.testing.assert_array_equal(got, expected)
  drawn = _descents(monkeypatch, "pallas", draw, tree, jax.random.key(0), jnp.int32(0))
  assert np.all(leaves[np.asarray(drawn.indices)] > 0)
  assert float(drawn.smallest) == float(np.min(np.asarray(drawn.values)))
  empty = _descents(monkeypatch, "pallas", draw, sum_tree.init(num_leaves), jax.random.key(0), 5)
  assert np.all((np.asarray(empty.indices) >= 0) & (np.asarray(empty.indices) < 5))
  assert not np.any(np.asarray(empty.values))


def test_stratified_draws_take_each_stratum_once_in_a_uniformly_random_order(monkeypatch):
  # The strata order is the ranks of random keys: a permutation of the
  # strata in every draw, each stratum equally likely at each position.
  monkeypatch.setenv(sum_tree.KERNEL_VARIANT_VARIABLE, "pallas")
  tree = sum_tree.from_leaves(jnp.ones(64, jnp.float32))
  draw = jax.jit(lambda key: sum_tree.draw_leaves(tree, key, 8, stratified=True).indices)
  positions = np.zeros((8, 8))
  for seed in range(400):
    strata = np.asarray(draw(jax.random.key(seed))) // 8
    assert sorted(strata.tolist()) == list(range(8))
    positions[np.arange(8), strata] += 1
  # 400 draws: 50 expected per cell; chi-square over 49 degrees of freedom.
  chi_square = float(np.sum((positions - 50.0) ** 2 / 50.0))
  assert chi_square < 90.0, chi_square  # p about 3e-4


def test_writes_with_a_running_largest_and_leaf_values_give_the_xla_tree(monkeypatch):
  _, tree = _tree(5000, seed=4)
  rng = np.random.default_rng(5)
  indices = jnp.asarray(rng.integers(0, 800, 256), jnp.int32)
  priorities = jnp.asarray(rng.uniform(0, 5, 256), jnp.float32)
  valid = jnp.asarray(rng.random(256) < 0.7)

  def write(tree, indices, priorities, valid, running):
    return sum_tree.write_leaves(
      tree,
      indices,
      priorities,
      valid,
      largest_of=(running, jnp.where(valid, priorities, 0.0)),
      leaf_values=lambda p: jnp.minimum(p**0.6, 3.0),
    )

  for running in (jnp.float32(1.0), jnp.float32(9.0)):
    arguments = (tree, indices, priorities, valid, running)
    xla = _descents(monkeypatch, "xla", write, *arguments)
    pallas = _descents(monkeypatch, "pallas", write, *arguments)
    for got, expected in zip(jax.tree.leaves(pallas), jax.tree.leaves(xla), strict=True):
      np.testing.assert_array_equal(got, expected)
    assert float(pallas[1]) == max(float(running), float(np.max(np.where(valid, priorities, 0))))
  # One value for every write (an add at the running maximum), ring slots.
  one = lambda tree, slots: sum_tree.write_leaves(
    tree, slots, jnp.float32(2.0), unique_indices=True, leaf_values=lambda p: p**0.6
  )[0]
  slots = jnp.arange(100, 228, dtype=jnp.int32)
  xla = _descents(monkeypatch, "xla", one, tree, slots)
  pallas = _descents(monkeypatch, "pallas", one, tree, slots)
  for got, expected in zip(pallas.levels, xla.levels, strict=True):
    np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(pallas.levels[0][100:228], np.float32(2.0) ** np.float32(0.6))


def test_the_variant_defaults_to_xla_on_the_cpu_and_an_unknown_one_is_refused(monkeypatch):
  monkeypatch.delenv(sum_tree.KERNEL_VARIANT_VARIABLE, raising=False)
  assert sum_tree.kernel_variant() == "xla"
  assert sum_tree.kernel_variant("cpu") == "xla"
  assert sum_tree.kernel_variant("cuda") == "pallas"
  assert sum_tree.kernel_variant("tpu") == "xla"
  monkeypatch.setenv(sum_tree.KERNEL_VARIANT_VARIABLE, "triton")
  with pytest.raises(
    ValueError, match=r"JAXBUF_SUM_TREE_KERNELS='triton'.*'xla', 'pallas_descent', 'pallas'"
  ):
    sum_tree.kernel_variant()


def _lowered_text(function, arguments, platform: str) -> str:
  try:
    return jax.jit(function).trace(*arguments).lower(lowering_platforms=(platform,)).as_text()
  except (NotImplementedError, RuntimeError, ImportError) as error:  # no Triton bindings
    pytest.skip(f"Triton lowering unavailable here: {error}")


def test_the_compile_target_chooses_the_kernels_not_the_default_backend(monkeypatch):
  # A program lowered for CUDA in this CPU process (a deviceless compile)
  # gets the Triton kernels; lowered for the CPU, the XLA operations; one
  # traced function serves both.
  monkeypatch.delenv(sum_tree.KERNEL_VARIANT_VARIABLE, raising=False)
  buffer = jaxbuf.prioritized_replay(40_000)
  state = buffer.init({"obs": jnp.zeros(4)})

  def step(state, key):
    state = buffer.add(state, {"obs": jnp.ones((128, 4))})
    batch = buffer.sample(state, key, 256)
    return buffer.update_priorities(state, batch.indices, batch.items["obs"][:, 0] + 1.0)

  arguments = (state, jax.random.key(0))
  cuda = _lowered_text(step, arguments, "cuda")
  assert cuda.count("__gpu$xla.gpu.triton") == 3  # the add's write, the draw, the update's write
  for name in ("sum_tree_draw", "sum_tree_write"):
    assert f'name = "{name}"' in cuda
  assert "__gpu$xla.gpu.triton" not in _lowered_text(step, arguments, "cpu")


def test_the_kernels_lower_for_a_gpu_as_one_triton_call_each():
  tree = sum_tree.init(40_000)
  targets = jnp.zeros(256, jnp.float32)
  redraws = jnp.zeros((sum_tree.num_redraws(tree), 256), jnp.float32)
  indices = jnp.arange(200, dtype=jnp.int32)
  bits = jnp.zeros((3 + sum_tree.num_redraws(tree), 256), jnp.uint32)

  def kernels(levels, targets, redraws, indices, bits):
    found, values = sum_tree_kernels.descend(
      tuple(reversed(levels[:-1])),
      targets,
      redraws,
      branching=sum_tree.BRANCHING,
      levels_per_target=sum_tree.LEVELS_PER_TARGET,
      interpret=False,
    )
    written = sum_tree_kernels.write_leaves(
      levels,
      indices,
      values[: indices.shape[0]],
      indices >= 0,
      (jnp.float32(1), values[: indices.shape[0]]),
      branching=sum_tree.BRANCHING,
      unique_indices=False,
      leaf_values=None,
      interpret=False,
    )
    drawn = sum_tree_kernels.draw(
      tuple(reversed(levels)),
      bits,
      jnp.int32(5),
      branching=sum_tree.BRANCHING,
      levels_per_target=sum_tree.LEVELS_PER_TARGET,
      stratified=True,
      interpret=False,
    )
    return found, written, drawn

  text = _lowered_text(kernels, (tree.levels, targets, redraws, indices, bits), "cuda")
  assert text.count("__gpu$xla.gpu.triton") == 3
  for name in ("sum_tree_descent", "sum_tree_write", "sum_tree_draw"):
    assert f'name = "{name}"' in text
