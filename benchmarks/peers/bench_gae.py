"""GAE and the on-policy PPO data path: jaxbuf vs rlax vs PureJaxRL, one process.

Shape key: T rollout length, N envs, E epochs, M minibatches.

Part 1, GAE. Every variant computes advantages and returns (`advantages +
values`) for float32 `[T, N]` rewards, values and done flags, jitted, and is
timed after compilation (median of repeats, `block_until_ready`):

* jaxbuf scan: `jaxbuf.compute_gae`, the sequential reverse `lax.scan`.
* jaxbuf assoc: `jaxbuf.compute_gae(..., associative=True)`.
* jaxbuf full: the scan variant with truncation (`truncated`,
  `truncated_values`) and a ragged `valid` mask, the features rlax lacks.
* rlax vmap: `rlax.truncated_generalized_advantage_estimation` vmapped over
  N, including building its `[T + 1]` values and discounts.
* purejaxrl: the reverse scan of PureJaxRL's `ppo.py`, written here (carry
  `(gae, next_value)`, `unroll=16`).

The floor is memory traffic: three `[T, N]` float32 inputs read and two
written, `5 * 4 * T * N` bytes.

Part 2, one PPO update's data path with a CartPole-sized step (obs `[4]`,
action, log-prob, value, reward, terminated, truncated, truncated value):
collect T steps in a `lax.scan` (random data stands in for the env and
policy) adding each to a `jaxbuf.rollout_buffer` (state donated), then
`compute_gae` with truncation, `normalize_advantages`, and E epochs of
`shuffled_minibatches` whose minibatches are reduced (standing in for the
loss). The baseline is PureJaxRL's way: the scan stacks its outputs as `ys`
(no buffer), its GAE, a global normalisation, and the same permutation
gather (`jax.random.permutation`; jaxbuf's own permutation sorts once by
64 random bits, see `jaxbuf._src.core.random.permutation`). The "collect" columns
time the collection alone: the cost of writing into the buffer against
stacking scan outputs.

Usage:
  .venv/bin/python benchmarks/peers/bench_gae.py           # full table, minutes
  .venv/bin/python benchmarks/peers/bench_gae.py --quick   # smoke run, seconds
"""

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import rlax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf

GAMMA, GAE_LAMBDA = 0.99, 0.95
OBS_SIZE = 4
EPOCHS, MINIBATCHES = 4, 4


def repeats_for(num_items: int, repeats: int) -> int:
  """More repeats for small, fast, noisy shapes; at least `repeats`."""
  return max(repeats, min(20 * repeats, int(repeats * 2**18 / num_items)))


# ------------------------------------------------------------------ GAE


def rlax_gae(rewards, values, dones, last_value):
  discounts = GAMMA * (1.0 - dones)
  bootstrap_values = jnp.concatenate([values, last_value[None]])
  advantages = jax.vmap(
    rlax.truncated_generalized_advantage_estimation, in_axes=(1, 1, None, 1), out_axes=1
  )(rewards, discounts, GAE_LAMBDA, bootstrap_values)
  return advantages, advantages + values


def purejaxrl_gae(rewards, values, dones, last_value):
  def get_advantages(gae_and_next_value, transition):
    gae, next_value = gae_and_next_value
    done, value, reward = transition
    delta = reward + GAMMA * next_value * (1 - done) - value
    gae = delta + GAMMA * GAE_LAMBDA * (1 - done) * gae
    return (gae, value), gae

  _, advantages = jax.lax.scan(
    get_advantages,
    (jnp.zeros_like(last_value), last_value),
    (dones, values, rewards),
    reverse=True,
    unroll=16,
  )
  return advantages, advantages + values


def jaxbuf_gae(rewards, values, dones, last_value, *, associative):
  return jaxbuf.compute_gae(
    rewards, values, dones, last_value, gamma=GAMMA, gae_lambda=GAE_LAMBDA, associative=associative
  )


def jaxbuf_gae_full(rewards, values, dones, last_value, truncated, truncated_values, valid):
  return jaxbuf.compute_gae(
    rewards,
    values,
    dones,
    last_value,
    gamma=GAMMA,
    gae_lambda=GAE_LAMBDA,
    truncated=truncated,
    truncated_values=truncated_values,
    valid=valid,
  )


def gae_inputs(num_steps: int, num_envs: int):
  keys = jax.random.split(jax.random.key(0), 6)
  shape = (num_steps, num_envs)
  rewards = jax.random.normal(keys[0], shape)
  values = jax.random.normal(keys[1], shape)
  dones = (jax.random.uniform(keys[2], shape) < 0.01).astype(jnp.float32)
  last_value = jax.random.normal(keys[3], (num_envs,))
  truncated = jax.random.uniform(keys[4], shape) < 0.005
  truncated_values = jax.random.normal(keys[5], shape)
  counts = jnp.full((num_envs,), num_steps).at[::2].set(num_steps - 3)
  valid = jnp.arange(num_steps)[:, None] < counts[None, :]
  return (rewards, values, dones, last_value), (truncated, truncated_values, valid)


def bench_gae(shapes, repeats):
  variants = {
    "jaxbuf scan": jax.jit(functools.partial(jaxbuf_gae, associative=False)),
    "jaxbuf assoc": jax.jit(functools.partial(jaxbuf_gae, associative=True)),
    "rlax vmap": jax.jit(rlax_gae),
    "purejaxrl": jax.jit(purejaxrl_gae),
  }
  full = jax.jit(jaxbuf_gae_full)
  rows = []
  for num_steps, num_envs in shapes:
    inputs, extras = gae_inputs(num_steps, num_envs)
    reference = variants["rlax vmap"](*inputs)[0]
    for function in variants.values():
      np.testing.assert_allclose(function(*inputs)[0], reference, rtol=2e-3, atol=2e-3)
    calls = {name: functools.partial(function, *inputs) for name, function in variants.items()}
    calls["jaxbuf full"] = functools.partial(full, *inputs, *extras)
    times = harness.time_interleaved(calls, repeats=repeats_for(num_steps * num_envs, repeats))
    floor_mb = 5 * 4 * num_steps * num_envs / 1e6
    rows.append((num_steps, num_envs, floor_mb, times))
  return rows


# ------------------------------------------------------------ PPO data path


def example_step():
  return {
    "obs": jnp.zeros(OBS_SIZE),
    "action": jnp.int32(0),
    "log_prob": jnp.float32(0),
    "value": jnp.float32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
    "truncated_value": jnp.float32(0),
  }


def fake_step(key, num_envs):
  """Random data standing in for one vectorised env + policy step."""
  k = jax.random.split(key, 4)
  return {
    "obs": jax.random.normal(k[0], (num_envs, OBS_SIZE)),
    "action": jax.random.randint(k[1], (num_envs,), 0, 2),
    "log_prob": jnp.full((num_envs,), -0.69),
    "value": jax.random.normal(k[2], (num_envs,)),
    "reward": jnp.ones((num_envs,)),
    "terminated": jax.random.uniform(k[3], (num_envs,)) < 0.01,
    "truncated": jnp.zeros((num_envs,), bool),
    "truncated_value": jnp.zeros((num_envs,)),
  }


def consume(total, minibatch):
  """Stands in for the loss: reads every leaf of the minibatch."""
  return total + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(minibatch)), None


def total_of(tree):
  """Reads every leaf, so no part of the work is dead code."""
  return consume(0.0, tree)[0]


def make_jaxbuf_update(num_steps, num_envs, *, collect_only=False):
  rollout = jaxbuf.rollout_buffer(num_steps, num_envs)

  def update(state, key):
    state = rollout.reset(state)

    def collect(state, key):
      return rollout.add(state, fake_step(key, num_envs)), None

    collect_key, last_key, shuffle_key = jax.random.split(key, 3)
    state, _ = jax.lax.scan(collect, state, jax.random.split(collect_key, num_steps))
    data = state.data
    if collect_only:
      return state, total_of(data)
    advantages, returns = jaxbuf.compute_gae(
      data["reward"],
      data["value"],
      data["terminated"],
      jax.random.normal(last_key, (num_envs,)),
      gamma=GAMMA,
      gae_lambda=GAE_LAMBDA,
      truncated=data["truncated"],
      truncated_values=data["truncated_value"],
    )
    batch = {**data, "advantage": jaxbuf.normalize_advantages(advantages), "return": returns}

    def epoch(total, key):
      minibatches = jaxbuf.shuffled_minibatches(key, batch, num_minibatches=MINIBATCHES)
      return jax.lax.scan(consume, total, minibatches)[0], None

    total, _ = jax.lax.scan(epoch, 0.0, jax.random.split(shuffle_key, EPOCHS))
    return state, total

  return jax.jit(update, donate_argnums=0), rollout.init(example_step())


def make_purejaxrl_update(num_steps, num_envs, *, collect_only=False):
  def update(key):
    def collect(carry, key):
      return carry, fake_step(key, num_envs)

    collect_key, last_key, shuffle_key = jax.random.split(key, 3)
    _, data = jax.lax.scan(collect, None, jax.random.split(collect_key, num_steps))
    if collect_only:
      return total_of(data)
    advantages, returns = purejaxrl_gae(
      data["reward"],
      data["value"],
      data["terminated"].astype(jnp.float32),
      jax.random.normal(last_key, (num_envs,)),
    )
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    batch = {**data, "advantage": advantages, "return": returns}

    def epoch(total, key):
      permutation = jax.random.permutation(key, num_steps * num_envs)
      shuffled = jax.tree.map(
        lambda x: jnp.take(
          x.reshape((num_steps * num_envs,) + x.shape[2:]), permutation, axis=0
        ).reshape((MINIBATCHES, -1) + x.shape[2:]),
        batch,
      )
      return jax.lax.scan(consume, total, shuffled)[0], None

    total, _ = jax.lax.scan(epoch, 0.0, jax.random.split(shuffle_key, EPOCHS))
    return total

  return jax.jit(update)


def bench_ppo(shapes, repeats):
  rows = []
  for num_steps, num_envs in shapes:
    key = jax.random.key(1)
    calls = {}
    for collect_only in (True, False):
      jaxbuf_update, state = make_jaxbuf_update(num_steps, num_envs, collect_only=collect_only)
      baseline = make_purejaxrl_update(num_steps, num_envs, collect_only=collect_only)
      part = "collect" if collect_only else "update"
      calls[f"jaxbuf {part}"] = harness.carrying(
        lambda state, update=jaxbuf_update: update(state, key), state
      )
      calls[f"purejaxrl {part}"] = functools.partial(baseline, key)
    rows.append((num_steps, num_envs, harness.time_interleaved(calls, repeats=repeats)))
  return rows


# ---------------------------------------------------------------- report


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--quick", action="store_true", help="small shapes and few repeats: a smoke run"
  )
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args()
  if args.quick:
    gae_shapes, ppo_shapes, repeats = [(128, 64)], [(128, 64)], 3
  else:
    gae_shapes = [(128, 64), (128, 4096), (2048, 64), (2048, 4096)]
    ppo_shapes = [(128, 64), (128, 4096), (2048, 64)]
    repeats = 10
  repeats = args.repeats or repeats

  harness.print_machine(("jax", "jaxlib", "numpy", "rlax"))
  print(
    f"GAE, gamma={GAMMA}, lambda={GAE_LAMBDA}: median ms per call "
    f"(at least {repeats} interleaved repeats, more for small shapes); "
    "ratio = rlax time / this time (>1: faster than rlax)"
  )
  names = ("jaxbuf scan", "jaxbuf assoc", "jaxbuf full", "rlax vmap", "purejaxrl")
  print("| T | N | floor MB | " + " | ".join(names) + " | scan vs rlax | assoc vs rlax |")
  print("|---|---|---|" + "---|" * (len(names) + 2))
  for num_steps, num_envs, floor_mb, times in bench_gae(gae_shapes, repeats):
    rlax_time = times["rlax vmap"]
    print(
      f"| {num_steps} | {num_envs} | {floor_mb:.1f} | "
      + " | ".join(f"{1e3 * times[name]:.3f}" for name in names)
      + f" | {rlax_time / times['jaxbuf scan']:.2f}x"
      + f" | {rlax_time / times['jaxbuf assoc']:.2f}x |"
    )

  print()
  print(
    f"PPO data path per update (collect T steps into the buffer, GAE with "
    f"truncation, normalise, {EPOCHS} epochs x {MINIBATCHES} shuffled "
    f"minibatches): median ms of {repeats} interleaved repeats"
  )
  print(
    "| T | N | collect: jaxbuf add | collect: scan ys | update: jaxbuf | "
    "update: purejaxrl-style | update ratio |"
  )
  print("|---|---|---|---|---|---|---|")
  for num_steps, num_envs, times in bench_ppo(ppo_shapes, repeats):
    print(
      f"| {num_steps} | {num_envs} | "
      + " | ".join(
        f"{1e3 * times[name]:.2f}"
        for name in ("jaxbuf collect", "purejaxrl collect", "jaxbuf update", "purejaxrl update")
      )
      + f" | {times['purejaxrl update'] / times['jaxbuf update']:.2f}x |"
    )


if __name__ == "__main__":
  main()
