"""Env steps per second of whole training loops: fused on device vs host buffer.

The fused loops are the examples' own programs (`examples/dqn.py`,
`examples/ppo.py`): env stepping, jaxbuf buffer, loss and optax update in one
jitted `lax.scan`. The host-buffer loops run the same networks, losses and
updates, jitted the same way, but keep experience in a NumPy ring buffer /
NumPy rollout arrays fed by `jax.device_get` after every env step, and send
each sampled batch (DQN) or rollout (PPO) back to the device: the pattern of
a PyTorch-style loop ported to JAX. The difference is the cost of the host
round trips and of the Python loop around them.

  .venv/bin/python benchmarks/features/bench_loops.py            # about a minute on 2 cores
  .venv/bin/python benchmarks/features/bench_loops.py --quick    # fewer timed iterations
  .venv/bin/python benchmarks/features/bench_loops.py --num-envs 1024 4096   # wide (GPU)

Each loop runs with the examples' default CartPole-v1 settings (DQN: 10 envs,
one update of batch 128 per vectorized step; PPO: 4 envs x 128 steps, 4
epochs of 4 minibatches), one seed, timed after a warm-up that compiles and
(for DQN) fills the buffer past `learning_starts`, so every timed DQN
iteration learns.
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from examples import dqn  # noqa: E402
from examples import ppo  # noqa: E402
from examples import training  # noqa: E402

from benchmarks.common import harness
from benchmarks.common import hlo_kernels
import jaxbuf  # noqa: E402
from jaxbuf._src.core import sum_tree as jaxbuf_sum_tree  # noqa: E402


def time_fused(
  module, config, iterations_per_chunk: int, num_chunks: int, num_seeds: int = 1
) -> float:
  """Env steps/s of the example's own jitted chunk runner (vmapped over seeds)."""
  return time_fused_counted(module, config, iterations_per_chunk, num_chunks, num_seeds)[0]


def time_fused_counted(
  module,
  config,
  iterations_per_chunk: int,
  num_chunks: int,
  num_seeds: int = 1,
  variant: str | None = None,
) -> tuple[float, int | None]:
  """`time_fused`, compiled under the sum tree descent `variant` (None: the
  backend's), and the kernels one iteration launches (`hlo_kernels.py`)."""
  trainer = module.make_trainer(config)
  runner = training.make_chunk_runner(trainer.step, iterations_per_chunk)
  state = jax.jit(jax.vmap(trainer.init))(jax.random.split(jax.random.key(0), num_seeds))
  with harness.sum_tree_kernels(variant):
    compiled = runner.lower(state).compile()
  kernels = hlo_kernels.kernels_per_iteration(compiled.as_text(), iterations_per_chunk)
  # Warm-up chunks: DQN fills its buffer past learning_starts.
  warmup_chunks = (
    -(-config.learning_starts // (config.num_envs * iterations_per_chunk)) if module is dqn else 1
  )
  for _ in range(max(warmup_chunks, 1)):
    state, metrics = compiled(state)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(num_chunks):
    state, metrics = compiled(state)
    jax.device_get(metrics)  # as the examples do, to move the progress bar
  seconds = time.perf_counter() - start
  steps_per_iteration = config.num_envs if module is dqn else config.num_envs * config.num_steps
  return num_seeds * num_chunks * iterations_per_chunk * steps_per_iteration / seconds, kernels


class NumpyReplay:
  """A uniform ring buffer of transitions in host memory."""

  def __init__(self, example: dict[str, np.ndarray], capacity: int):
    self.storage = {
      name: np.zeros((capacity, *np.shape(value)), np.asarray(value).dtype)
      for name, value in example.items()
    }
    self.capacity, self.position, self.size = capacity, 0, 0
    self.rng = np.random.default_rng(0)

  def add(self, items: dict[str, np.ndarray]) -> None:
    batch_size = len(next(iter(items.values())))
    slots = (self.position + np.arange(batch_size)) % self.capacity
    for name, value in items.items():
      self.storage[name][slots] = value
    self.position = (self.position + batch_size) % self.capacity
    self.size = min(self.size + batch_size, self.capacity)

  def sample(self, batch_size: int) -> dict[str, np.ndarray]:
    indices = self.rng.integers(0, self.size, batch_size)
    return {name: value[indices] for name, value in self.storage.items()}


def time_dqn_host(config: dqn.Config, num_iterations: int) -> float:
  """DQN with the same network, loss and optimizer; replay in NumPy."""
  import gymnax

  env, env_params = gymnax.make(config.env_name)
  num_actions = env.action_space(env_params).n
  network = dqn.QNetwork(num_actions, config.hidden_size)
  optimizer = optax.chain(
    optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate)
  )
  epsilon = config.epsilon_end  # the annealing schedule does not change the cost

  @jax.jit
  def act_and_step(params, env_state, obs, key):
    explore_key, action_key, env_key = jax.random.split(key, 3)
    greedy = network.apply(params, obs).argmax(axis=-1)
    random_actions = jax.random.randint(action_key, greedy.shape, 0, num_actions)
    explore = jax.random.uniform(explore_key, greedy.shape) < epsilon
    actions = jnp.where(explore, random_actions, greedy).astype(jnp.int32)
    next_obs, env_state, rewards, terminated, _, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
      jax.random.split(env_key, config.num_envs), env_state, actions, env_params
    )
    transition = dict(
      obs=obs,
      action=actions,
      reward=rewards.astype(jnp.float32),
      next_obs=info["final_observation"],
      terminated=terminated,
    )
    return env_state, next_obs, transition

  @jax.jit
  def learn(params, target_params, opt_state, batch):
    def loss_fn(params):
      q_values = network.apply(params, batch["obs"])
      q_taken = jnp.take_along_axis(q_values, batch["action"][:, None], axis=-1)[:, 0]
      next_q_values = network.apply(target_params, batch["next_obs"])
      if config.double_q:
        next_actions = network.apply(params, batch["next_obs"]).argmax(axis=-1)
        next_q = jnp.take_along_axis(next_q_values, next_actions[:, None], axis=-1)[:, 0]
      else:
        next_q = next_q_values.max(axis=-1)
      target = (
        batch["reward"] + config.gamma * (1.0 - batch["terminated"].astype(jnp.float32)) * next_q
      )
      return jnp.mean(0.5 * (q_taken - jax.lax.stop_gradient(target)) ** 2)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  key = jax.random.key(0)
  key, reset_key, network_key = jax.random.split(key, 3)
  obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
    jax.random.split(reset_key, config.num_envs), env_params
  )
  params = network.init(network_key, obs[0])
  target_params, opt_state = params, optimizer.init(params)
  replay = NumpyReplay(
    jax.device_get(
      jax.tree.map(
        lambda x: x[0],
        dict(
          obs=obs,
          action=jnp.zeros(config.num_envs, jnp.int32),
          reward=jnp.zeros(config.num_envs),
          next_obs=obs,
          terminated=jnp.zeros(config.num_envs, bool),
        ),
      )
    ),
    config.buffer_size,
  )
  target_period = max(config.target_update_interval // config.num_envs, 1)

  def run(iterations, key, env_state, obs, params, target_params, opt_state, start_iteration):
    for iteration in range(start_iteration, start_iteration + iterations):
      key, step_key = jax.random.split(key)
      env_state, obs, transition = act_and_step(params, env_state, obs, step_key)
      replay.add(jax.device_get(transition))
      if replay.size >= config.batch_size:
        params, opt_state = learn(
          params, target_params, opt_state, replay.sample(config.batch_size)
        )
      if iteration % target_period == 0:
        target_params = params
    jax.block_until_ready(params)
    return key, env_state, obs, params, target_params, opt_state

  warmup = config.learning_starts // config.num_envs
  carry = run(warmup, key, env_state, obs, params, target_params, opt_state, 0)
  start = time.perf_counter()
  run(num_iterations, *carry, warmup)
  seconds = time.perf_counter() - start
  return num_iterations * config.num_envs / seconds


def time_ppo_host(config: ppo.Config, num_updates: int) -> float:
  """PPO with the same network and loss; the rollout gathered in NumPy."""
  import gymnax

  env, env_params = gymnax.make(config.env_name)
  num_actions = env.action_space(env_params).n
  network = ppo.ActorCritic(num_actions, config.hidden_size)
  optimizer = optax.chain(
    optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate, eps=1e-5)
  )

  @jax.jit
  def act_and_step(params, env_state, obs, key):
    action_key, env_key = jax.random.split(key)
    logits, value = network.apply(params, obs)
    action = jax.random.categorical(action_key, logits).astype(jnp.int32)
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
    next_obs, env_state, reward, terminated, truncated, info = jax.vmap(
      env.step, in_axes=(0, 0, 0, None)
    )(jax.random.split(env_key, config.num_envs), env_state, action, env_params)
    _, truncated_value = network.apply(params, info["final_observation"])
    step = dict(
      obs=obs,
      action=action,
      log_prob=log_prob,
      value=value,
      reward=reward.astype(jnp.float32),
      terminated=terminated,
      truncated=truncated,
      truncated_value=truncated_value,
    )
    return env_state, next_obs, step

  @jax.jit
  def update(params, opt_state, data, last_obs, key):
    _, last_value = network.apply(params, last_obs)
    batch = ppo.training_batch(data, last_value, config)

    def gradient_step(carry, minibatch):
      params, opt_state = carry
      grads = jax.grad(
        lambda p: ppo.ppo_loss(*network.apply(p, minibatch["obs"]), minibatch, config)
      )(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), None

    def epoch(carry, key):
      minibatches = jaxbuf.shuffled_minibatches(key, batch, num_minibatches=config.num_minibatches)
      return jax.lax.scan(gradient_step, carry, minibatches)[0], None

    return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, config.update_epochs))[0]

  key, reset_key, network_key = jax.random.split(jax.random.key(0), 3)
  obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
    jax.random.split(reset_key, config.num_envs), env_params
  )
  params = network.init(network_key, obs)
  opt_state = optimizer.init(params)

  def run(updates, key, env_state, obs, params, opt_state):
    for _ in range(updates):
      steps = []
      for _ in range(config.num_steps):
        key, step_key = jax.random.split(key)
        env_state, obs, step = act_and_step(params, env_state, obs, step_key)
        steps.append(jax.device_get(step))
      rollout = {name: np.stack([s[name] for s in steps]) for name in steps[0]}
      key, update_key = jax.random.split(key)
      params, opt_state = update(params, opt_state, rollout, obs, update_key)
    jax.block_until_ready(params)
    return key, env_state, obs, params, opt_state

  carry = run(1, key, env_state, obs, params, opt_state)
  start = time.perf_counter()
  run(num_updates, *carry)
  seconds = time.perf_counter() - start
  return num_updates * config.num_steps * config.num_envs / seconds


def wide_rows(
  num_envs: int, scale: int, variants: tuple[str | None, ...] = (None,)
) -> list[tuple[str, float]]:
  """The fused DQN and PPO loops at N vmapped envs (one seed); prioritized
  DQN once per sum tree kernel variant (None: the backend's default).

  DQN: one update of batch 128 per vector step of N envs, a replay buffer of
  100 N steps (at least 10,000) filled past 10 N steps before timing; PPO:
  N envs x 128 steps per update, 4 epochs of 4 minibatches. Each row's
  kernels per iteration (from the compiled HLO) are printed as it is timed.
  """
  dqn_config = dataclasses.replace(
    dqn.Config(),
    num_envs=num_envs,
    buffer_size=max(10_000, 100 * num_envs),
    learning_starts=10 * num_envs,
  )
  ppo_config = dataclasses.replace(ppo.Config(), num_envs=num_envs)
  runs = [
    (
      f"DQN prioritized, fused, {num_envs} envs" + (f" ({variant})" if variant else ""),
      dqn,
      dqn_config,
      50,
      2 * scale,
      variant,
    )
    for variant in variants
  ]
  runs += [
    (
      f"DQN uniform, fused, {num_envs} envs",
      dqn,
      dataclasses.replace(dqn_config, replay="uniform"),
      50,
      2 * scale,
      None,
    ),
    (f"PPO, fused, {num_envs} envs", ppo, ppo_config, 2, scale, None),
  ]
  rows = []
  for name, module, config, iterations, chunks, variant in runs:
    steps_per_second, kernels = time_fused_counted(
      module, config, iterations, chunks, variant=variant
    )
    print(f"info  {name}: {kernels} kernels per iteration", flush=True)
    rows.append((name, steps_per_second))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer timed iterations (noisier)")
  parser.add_argument(
    "--num-envs",
    type=int,
    nargs="+",
    metavar="N",
    help="instead of the default settings: the fused DQN "
    "and PPO loops at each N vmapped envs (wide_rows)",
  )
  parser.add_argument(
    "--kernel-variants",
    nargs="+",
    choices=jaxbuf_sum_tree.KERNEL_VARIANTS,
    help="with --num-envs: time prioritized DQN under each sum tree kernel variant",
  )
  args = parser.parse_args()
  scale = 1 if args.quick else 4
  if args.num_envs:
    harness.print_machine(("jax", "jaxlib", "numpy", "flax", "optax", "gymnax"))
    print_rows(
      f"loop ({ppo.Config.env_name}, N vmapped envs)",
      [
        row
        for num_envs in args.num_envs
        for row in wide_rows(num_envs, scale, tuple(args.kernel_variants or (None,)))
      ],
    )
    return
  dqn_config = dqn.Config()
  ppo_config = ppo.Config()
  harness.print_machine(("jax", "jaxlib", "numpy", "flax", "optax", "gymnax"))
  rows = []
  rows.append(
    (
      "DQN uniform, fused (jaxbuf)",
      time_fused(dqn, dqn_config, iterations_per_chunk=500, num_chunks=2 * scale),
    )
  )
  rows.append(
    (
      "DQN prioritized, fused (jaxbuf)",
      time_fused(
        dqn,
        dataclasses.replace(dqn_config, replay="prioritized"),
        iterations_per_chunk=500,
        num_chunks=2 * scale,
      ),
    )
  )
  rows.append(
    (
      "DQN uniform, fused, 4 seeds vmapped",
      time_fused(dqn, dqn_config, iterations_per_chunk=500, num_chunks=scale, num_seeds=4),
    )
  )
  rows.append(
    ("DQN uniform, host NumPy buffer", time_dqn_host(dqn_config, num_iterations=250 * scale))
  )
  rows.append(
    (
      "PPO, fused (jaxbuf)",
      time_fused(ppo, ppo_config, iterations_per_chunk=10, num_chunks=2 * scale),
    )
  )
  rows.append(
    (
      "PPO, fused, 4 seeds vmapped",
      time_fused(ppo, ppo_config, iterations_per_chunk=10, num_chunks=scale, num_seeds=4),
    )
  )
  rows.append(("PPO, host NumPy rollout", time_ppo_host(ppo_config, num_updates=2 * scale)))
  print_rows("loop (CartPole-v1, default example settings)", rows)


def print_rows(title: str, rows: list[tuple[str, float]]) -> None:
  width = max(len(name) for name, _ in rows + [(title, 0)])
  print(f"{title:<{width}}  env steps/s")
  for name, steps_per_second in rows:
    print(f"{name:<{width}}  {steps_per_second:>11,.0f}")
  for name, steps_per_second in rows:
    print(f"info  {name}: {steps_per_second:,.0f} env steps/s")


if __name__ == "__main__":
  main()
