"""`cond_update`: a `jax.lax.cond` that leaves buffer storage out of the select.

Under `vmap`, a `lax.cond` whose predicate is batched (say, "learning has
started", per seed) runs both branches and selects every output element by
element. When the outputs include a buffer state, the select reads and writes
the whole storage at every step, although learning (sample, priority update)
never writes it. `cond_update` finds, while tracing, every output that both
branches return unchanged from the operands, passes those through without a
select, and conds over the rest: the cost follows the work, not the capacity.
"""

from typing import Any, Callable, cast

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from jaxbuf._src.core.base import BufferState

_Forwarding = list[int | None]


# Primitives whose outputs are their `jaxpr`'s outputs, inputs matched one to
# one: calls (nested jits, `closed_call`, `jax.checkpoint`).
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")


def _scan_consts_and_carry(params: dict[str, Any]) -> tuple[int, int]:
  """How many of a `scan` equation's inputs are constants and carries.

  JAX up to 0.10 names the counts (`num_consts`, `num_carry`); later
  versions give the inputs' flat tree of (consts, carry, xs) as `ft_in`.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def _inner_source(eqn: Any, index: int, forwarding: Callable[[Any], _Forwarding]) -> int | None:
  """The input of `eqn` that its output `index` is, unchanged, or None.

  Calls forward what their body forwards. Loops (`scan`, `while`: several
  learning steps per env step) forward a carry their body returns as it
  came, which is what XLA cannot see through: there `lax.cond` copied the
  storage.
  """
  name = eqn.primitive.name
  if name in _CALLS:
    inner = eqn.params.get("jaxpr")
    if inner is None:
      return None
    return forwarding(inner)[index]
  if name == "scan":
    num_consts, num_carry = _scan_consts_and_carry(eqn.params)
    carry_input = num_consts + index
    if index < num_carry and (forwarding(eqn.params["jaxpr"])[index] == carry_input):
      return carry_input
    return None
  if name == "while":
    body_consts = eqn.params["body_nconsts"]
    if forwarding(eqn.params["body_jaxpr"])[index] == body_consts + index:
      return eqn.params["cond_nconsts"] + body_consts + index
    return None
  return None


def _forwarded_inputs(closed: Any) -> _Forwarding:
  """For each output of a (closed) jaxpr, the input it returns unchanged.

  None where the output is computed. Follows outputs through nested `jit`s
  (a buffer's jitted `update_priorities` returns the storage it was given,
  as a new variable of the outer program) and loop carries.
  """
  jaxpr = getattr(closed, "jaxpr", closed)
  position = {var: index for index, var in enumerate(jaxpr.invars)}
  producer = {}
  for eqn in jaxpr.eqns:
    for index, var in enumerate(eqn.outvars):
      producer[var] = (eqn, index)
  memo: dict[int, _Forwarding] = {}

  def forwarding(inner: Any) -> _Forwarding:
    if id(inner) not in memo:
      memo[id(inner)] = _forwarded_inputs(inner)
    return memo[id(inner)]

  def source(var: Any) -> int | None:
    while not isinstance(var, jax_core.Literal):
      if var in position:
        return position[var]
      if var not in producer:
        return None  # a constant
      eqn, index = producer[var]
      inner_index = _inner_source(eqn, index, forwarding)
      if inner_index is None:
        return None
      var = eqn.invars[inner_index]
    return None

  return [source(var) for var in jaxpr.outvars]


def _storage_positions(index_tree: Any) -> list[tuple[str, int]]:
  """(path, flat position) of every storage leaf of every buffer state in a
  tree whose leaves are their own flat positions."""
  found = []
  states = jax.tree_util.tree_flatten_with_path(
    index_tree, is_leaf=lambda node: isinstance(node, BufferState)
  )[0]
  for path, state in states:
    if isinstance(state, BufferState) and hasattr(state, "storage"):
      name = jax.tree_util.keystr(path)
      found += [
        (f"{name}.storage{jax.tree_util.keystr(leaf_path)}", position)
        for leaf_path, position in jax.tree_util.tree_flatten_with_path(state.storage)[0]
      ]
  return found


def cond_update(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
  """`jax.lax.cond(pred, true_fun, false_fun, *operands)`, with storage kept
  out of the select.

  Any output that both branches return unchanged from the operands is passed
  through, not selected. The storage of a buffer state among the outputs
  must be such an output: learning inside the branches may sample and update
  priorities (which never write the storage); adding items belongs outside
  the cond. Everything else is as `lax.cond`: each branch is traced once,
  and under `vmap` with a batched `pred` both run and the other outputs
  (priorities, counters, network parameters) are selected.

  Args:
    pred: a boolean scalar (batched under `vmap`).
    true_fun, false_fun: functions of `*operands` returning pytrees of the
      same structure, shapes and dtypes.
    *operands: pytrees of arrays; buffer states anywhere inside.

  Returns:
    The chosen branch's outputs.

  Raises:
    ValueError: if a branch returns the storage of a buffer state that is
      not an operand's storage passed through unchanged (written by `add`,
      say), naming the output; `lax.cond` would copy it under `vmap`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.prioritized_replay(1000)
  >>> state = buffer.add(buffer.init(jnp.zeros(4)), jnp.ones((8, 4)))
  >>> def learn(state, key):
  ...   batch = buffer.sample(state, key, 4)
  ...   return buffer.update_priorities(state, batch.indices, jnp.ones(4),
  ...                                   batch.item_ids)
  >>> step = jax.vmap(lambda learning, state, key: jaxbuf.cond_update(
  ...     learning, learn, lambda state, key: state, state, key))
  >>> states = jax.tree.map(lambda x: jnp.stack([x, x]), state)
  >>> keys = jax.random.split(jax.random.key(0), 2)
  >>> states = step(jnp.array([True, False]), states, keys)
  >>> states.beta_step.tolist()
  [1, 0]
  """
  flat, in_tree = jax.tree_util.tree_flatten(operands)

  def flat_branch(fun: Callable) -> Callable:
    return lambda *leaves: fun(*jax.tree_util.tree_unflatten(in_tree, leaves))

  true_jaxpr, true_shapes = jax.make_jaxpr(flat_branch(true_fun), return_shape=True)(*flat)
  false_jaxpr, false_shapes = jax.make_jaxpr(flat_branch(false_fun), return_shape=True)(*flat)
  out_tree: Any = jax.tree_util.tree_structure(true_shapes)
  if out_tree != jax.tree_util.tree_structure(false_shapes) or any(
    (a.shape, a.dtype) != (b.shape, b.dtype)
    for a, b in zip(jax.tree_util.tree_leaves(true_shapes), jax.tree_util.tree_leaves(false_shapes))
  ):
    # lax.cond's own message says how the branches differ.
    return jax.lax.cond(pred, true_fun, false_fun, *operands)
  true_forwarding = _forwarded_inputs(true_jaxpr)
  false_forwarding = _forwarded_inputs(false_jaxpr)

  storage_in = {
    position
    for _, position in _storage_positions(jax.tree_util.tree_unflatten(in_tree, range(len(flat))))
  }
  num_outputs = out_tree.num_leaves
  for name, position in _storage_positions(
    jax.tree_util.tree_unflatten(out_tree, range(num_outputs))
  ):
    for branch, forwarding in (("true_fun", true_forwarding), ("false_fun", false_forwarding)):
      if forwarding[position] not in storage_in or (
        true_forwarding[position] != false_forwarding[position]
      ):
        raise ValueError(
          f"cond_update: {branch} returns output{name} other than an "
          f"operand's storage passed through unchanged (items added inside "
          f"the cond?). Storage in a cond's outputs is selected, a copy "
          f"of the whole buffer under vmap: add outside the cond, or use "
          f"jax.lax.cond if the copy is intended."
        )

  selected = [
    index
    for index in range(num_outputs)
    if true_forwarding[index] is None or true_forwarding[index] != false_forwarding[index]
  ]

  def run(closed: jax_core.ClosedJaxpr) -> Callable:
    evaluate = jax_core.jaxpr_as_fun(closed)

    def branch(*leaves):
      outputs = evaluate(*leaves)
      return [outputs[index] for index in selected]

    return branch

  chosen = iter(jax.lax.cond(pred, run(true_jaxpr), run(false_jaxpr), *flat) if selected else [])
  outputs = [
    next(chosen) if index in selected else jnp.asarray(flat[cast(int, true_forwarding[index])])
    for index in range(num_outputs)
  ]
  return jax.tree_util.tree_unflatten(out_tree, outputs)
