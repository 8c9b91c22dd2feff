"""What the DQN and PPO examples share: the chunked training loop, curves, flags.

Shape key: K seeds, N envs, I iterations (a DQN vectorized env step, a PPO
update), P points of a learning curve.

Both examples build a `Trainer` (`init(key) -> state`,
`step(state) -> (state, metrics)`, each example with its own state and
metrics types, the metrics holding `returns_sum` and `episodes_ended` per
iteration) and hand it to `train_in_chunks`, which vmaps it over K seeds and
runs it as a few jitted chunks of a `lax.scan`, so the host only sees the
program between chunks to move the progress bar. Each script's `Config`
dataclass doubles as its command line through `parse_config`.
"""

import argparse
import dataclasses
import time
from typing import Any, Callable, NamedTuple

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import jaxbuf


class Trainer(NamedTuple):
  """Pure functions of one seed's training; vmap them over seeds."""
  init: Callable[[jax.Array], Any]       # key -> the example's RunnerState
  step: Callable[[Any], tuple[Any, Any]]  # state -> (state, its Metrics)


class VectorEnv(NamedTuple):
  """N copies of a gymnax environment; reset and step split their key N ways.

  Floating-point observations, rewards and `info` leaves come out float32
  whatever JAX's default dtypes (see `as_float32`); the env state keeps
  gymnax's own dtypes, since only gymnax reads it.
  """
  num_actions: int
  # key -> (obs [N, *obs_shape] float32, env_state with leaves [N, ...])
  reset: Callable[[jax.Array], tuple[jax.Array, Any]]
  # (key, env_state, actions [N]) -> (obs, env_state, reward [N] float32,
  # terminated [N], truncated [N], info), gymnax's step with auto-reset.
  step: Callable[[jax.Array, Any, jax.Array], tuple[Any, ...]]


def as_float32(tree: Any) -> Any:
  """`tree` with its floating-point leaves cast to float32, others kept.

  gymnax computes in JAX's default float dtype, float64 once
  `JAX_ENABLE_X64` is set. The examples' networks, buffers and `lax.cond`
  branches hold float32, and jaxbuf refuses a float64 leaf for float32
  storage rather than cast it silently, so values are cast where they leave
  the environment. Under 32-bit defaults this is a no-op.
  """
  return jax.tree.map(
      lambda leaf: (leaf.astype(jnp.float32)
                    if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf),
      tree)


class QLearningMetrics(NamedTuple):
  """Per-iteration statistics of the Q-learning examples; sums, so the host
  can average over any window."""
  returns_sum: jax.Array      # (), float32: summed returns of episodes ended now
  episodes_ended: jax.Array   # (), float32
  loss: jax.Array             # (), float32 (0 before learning starts)


def episode_metrics(episode_ended: jax.Array, episode_returns: jax.Array,
                    loss: jax.Array) -> QLearningMetrics:
  """The metrics of one iteration from `episode_ended` and the returns `[N]`."""
  return QLearningMetrics(
      returns_sum=jnp.sum(jnp.where(episode_ended, episode_returns, 0.0)),
      episodes_ended=jnp.sum(episode_ended.astype(jnp.float32)),
      loss=loss)


def epsilon_greedy(explore_key: jax.Array, action_key: jax.Array,
                   q_values: jax.Array, epsilon: jax.Array) -> jax.Array:
  """Actions int32 `[N]` from `q_values [N, A]`: uniform with probability
  `epsilon`, else the greedy one."""
  greedy = q_values.argmax(axis=-1)
  random_actions = jax.random.randint(action_key, greedy.shape, 0,
                                      q_values.shape[-1])
  explore = jax.random.uniform(explore_key, greedy.shape) < epsilon
  return jnp.where(explore, random_actions, greedy).astype(jnp.int32)


def td_learner(buffer: jaxbuf.Buffer, optimizer: optax.GradientTransformation,
               td_loss: Callable, batch_size: int,
               priorities: Callable = jnp.abs) -> Callable:
  """A Q-learning example's learner step, `learn(state, key)` for `learn_when`.

  `td_loss(params, target_params, sample) -> (loss, aux)`; the sampled
  items' new priorities are `priorities(aux)` (float32 `[S]`). Returns
  `(params, opt_state, buffer_state, loss)`: one optimizer step on a sample
  of `batch_size`, and its priorities updated.
  """
  def learn(state: Any, key: jax.Array):
    sample = buffer.sample(state.buffer_state, key, batch_size)
    (loss, aux), grads = jax.value_and_grad(td_loss, has_aux=True)(
        state.params, state.target_params, sample)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    buffer_state = buffer.update_priorities(
        state.buffer_state, sample.indices, priorities(aux), sample.item_ids)
    return (optax.apply_updates(state.params, updates), opt_state,
            buffer_state, loss)
  return learn


def learn_when(should_learn: jax.Array, learn: Callable, state: Any,
               key: jax.Array, *, target_period: int) -> tuple[Any, jax.Array]:
  """One learner step of a Q-learning example if `should_learn`: `(state, loss)`.

  `learn(state, key)` returns `(params, opt_state, buffer_state, loss)`; it
  may sample and update priorities but never adds. `state` has `params`,
  `opt_state`, `buffer_state`, `target_params` and `iteration`. The gate is
  `jaxbuf.cond_update`: vmapped over seeds whose predicates differ, a
  `lax.cond` is a select over every output, and a select over the replay
  storage would copy every seed's buffer at every step; the storage, which
  both branches pass through, is left out of it. Then the target network is
  copied every `target_period` iterations.
  """
  def skip(state, key):
    del key
    return (state.params, state.opt_state, state.buffer_state,
            jnp.zeros((), jnp.float32))

  params, opt_state, buffer_state, loss = jaxbuf.cond_update(
      should_learn, learn, skip, state, key)
  return state.replace(
      params=params, opt_state=opt_state, buffer_state=buffer_state,
      target_params=optax.periodic_update(params, state.target_params,
                                          state.iteration, target_period)
  ), loss


def make_vector_env(env_name: str, time_limit: int,
                    num_envs: int) -> VectorEnv:
  """`num_envs` vmapped copies of `gymnax.make(env_name)`.

  Args:
    env_name: a gymnax environment id, e.g. "CartPole-v1".
    time_limit: episode step limit; 0 keeps the environment's own.
    num_envs: N.

  Returns:
    A `VectorEnv` whose functions close over the environment parameters.
  """
  env, env_params = gymnax.make(env_name)
  if time_limit:
    env_params = env_params.replace(max_steps_in_episode=time_limit)
  vmapped_reset = jax.vmap(env.reset, in_axes=(0, None))
  vmapped_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

  def reset(key: jax.Array) -> tuple[jax.Array, Any]:
    obs, env_state = vmapped_reset(jax.random.split(key, num_envs), env_params)
    return as_float32(obs), env_state

  def step(key: jax.Array, env_state: Any,
           actions: jax.Array) -> tuple[Any, ...]:
    obs, env_state, reward, terminated, truncated, info = vmapped_step(
        jax.random.split(key, num_envs), env_state, actions, env_params)
    return (as_float32(obs), env_state, as_float32(reward), terminated,
            truncated, as_float32(info))

  return VectorEnv(num_actions=env.action_space(env_params).n, reset=reset,
                   step=step)


def make_chunk_runner(step: Callable, iterations_per_chunk: int) -> Callable:
  """`states [K, ...] -> (states, metrics [K, iterations_per_chunk])`, jitted.

  The states are donated, so the K replay buffers or rollout storages are
  updated in place from one chunk to the next rather than copied.
  """
  def run_chunk(state):
    return jax.lax.scan(lambda carry, _: step(carry), state, None,
                        length=iterations_per_chunk)
  return jax.jit(jax.vmap(run_chunk), donate_argnums=0)


def train_in_chunks(trainer: Trainer, *, num_iterations: int,
                    env_steps_per_iteration: int, num_chunks: int,
                    num_seeds: int, seed: int, description: str,
                    show_progress: bool = True) -> dict[str, Any]:
  """Trains `num_seeds` seeds of `trainer` at once; returns metrics and timings.

  Args:
    trainer: one seed's training, from the example's `make_trainer`.
    num_iterations: `step` calls per seed, rounded down to whole chunks.
    env_steps_per_iteration: env steps of one seed in one `step`.
    num_chunks: jitted calls, one progress-bar update each (at most one per
      iteration).
    num_seeds: K, seeds trained at once with vmap.
    seed: the seed of the key the K seeds' keys are split from.
    description: the progress bar's label, before ", K seed(s)".
    show_progress: False hides the progress bar (tests, notebooks).

  Returns:
    A dict: "returns_sum" and "episodes_ended" float `[K, I]` per iteration,
    "env_steps_per_iteration", "steps_per_second" (env steps of all seeds
    together per second of the training loop, compilation excluded),
    "env_steps_per_seed" (env steps of whole chunks), "compile_seconds",
    "final_mean_return" (mean episodic return over the last 10% of
    iterations, averaged over seeds) and "final_returns" `[K]`.
  """
  num_chunks = max(min(num_chunks, num_iterations), 1)
  iterations_per_chunk = max(num_iterations // num_chunks, 1)
  run_chunk = make_chunk_runner(trainer.step, iterations_per_chunk)

  env_steps_per_chunk = iterations_per_chunk * env_steps_per_iteration
  total_env_steps = num_chunks * env_steps_per_chunk * num_seeds
  # Counts the env steps of all seeds, like the steps per second printed.
  progress = tqdm.tqdm(total=total_env_steps,
                       unit=" env steps", unit_scale=True,
                       disable=not show_progress,
                       desc=f"{description}, {num_seeds} seed(s)")
  # Shown from the start: compiling the recurrent examples takes long enough
  # that a silent terminal looks hung.
  progress.set_postfix_str("compiling")
  seeds = jax.random.split(jax.random.key(seed), num_seeds)
  state = jax.jit(jax.vmap(trainer.init))(seeds)
  compile_start = time.perf_counter()
  compiled = run_chunk.lower(state).compile()
  compile_seconds = time.perf_counter() - compile_start
  # The bar's rate then counts training only, as the printed speed does.
  progress.set_postfix_str("training", refresh=False)
  progress.reset()

  chunks = []
  loop_start = time.perf_counter()
  for _ in range(num_chunks):
    state, metrics = compiled(state)
    metrics = jax.device_get(metrics)
    chunks.append(metrics)
    recent = metrics.returns_sum.sum() / max(metrics.episodes_ended.sum(), 1)
    progress.set_postfix(mean_return=f"{recent:.1f}")
    progress.update(env_steps_per_chunk * num_seeds)
  loop_seconds = time.perf_counter() - loop_start
  progress.close()

  returns_sum = np.concatenate([c.returns_sum for c in chunks], axis=1)
  episodes_ended = np.concatenate([c.episodes_ended for c in chunks], axis=1)
  final_returns = tail_mean_return(returns_sum, episodes_ended)
  return dict(returns_sum=returns_sum, episodes_ended=episodes_ended,
              env_steps_per_iteration=env_steps_per_iteration,
              env_steps_per_seed=total_env_steps // num_seeds,
              steps_per_second=total_env_steps / loop_seconds,
              compile_seconds=compile_seconds,
              final_returns=final_returns,
              final_mean_return=float(final_returns.mean()))


def tail_mean_return(returns_sum: np.ndarray, episodes_ended: np.ndarray,
                     fraction: float = 0.1) -> np.ndarray:
  """Mean episodic return per seed over the last `fraction` of iterations `[K]`."""
  tail = max(int(returns_sum.shape[1] * fraction), 1)
  return (returns_sum[:, -tail:].sum(axis=1)
          / np.maximum(episodes_ended[:, -tail:].sum(axis=1), 1))


def learning_curve(returns_sum: np.ndarray, episodes_ended: np.ndarray,
                   num_points: int = 50) -> tuple[np.ndarray, np.ndarray]:
  """Mean episodic return per seed in equal windows: `[P]`, `[K, P]`."""
  num_points = min(num_points, returns_sum.shape[1])
  num_iterations = returns_sum.shape[1] // num_points * num_points
  window = num_iterations // num_points
  sums = returns_sum[:, :num_iterations].reshape(-1, num_points, window).sum(-1)
  counts = episodes_ended[:, :num_iterations].reshape(-1, num_points,
                                                      window).sum(-1)
  centres = (np.arange(num_points) + 0.5) * window
  return centres, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_learning_curve(result: dict[str, Any], path: str, title: str,
                        color: str) -> None:
  """Saves each seed's curve (faint) and their mean, in `color`, to `path`."""
  from matplotlib.figure import Figure  # no pyplot: no GUI backend needed
  iterations, curves = learning_curve(result["returns_sum"],
                                      result["episodes_ended"])
  seeds_with_episodes = np.sum(~np.isnan(curves), axis=0)
  mean_curve = np.where(seeds_with_episodes > 0, np.nansum(curves, axis=0)
                        / np.maximum(seeds_with_episodes, 1), np.nan)
  env_steps = iterations * result["env_steps_per_iteration"]
  figure = Figure(figsize=(6, 3.5))
  axes = figure.subplots()
  for curve in curves:
    axes.plot(env_steps, curve, color=color, alpha=0.3, linewidth=1)
  axes.plot(env_steps, mean_curve, color=color,
            label=(f"mean of {len(curves)} seeds" if len(curves) > 1
                   else "1 seed"))
  axes.set(xlabel="env steps per seed", ylabel="episodic return", title=title)
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def plot_episode_returns(episode_returns: list[tuple[int, float]], path: str,
                         title: str, color: str, num_points: int = 50) -> None:
  """Saves each episode's return (faint dots, at the env step it ended) and
  their mean over `num_points` equal windows of env steps, to `path`.

  For the host-stepped examples, which tally episodes on the host as
  `(env step, return)` rather than in per-seed arrays.
  """
  from matplotlib.figure import Figure  # no pyplot: no GUI backend needed
  steps = np.array([step for step, _ in episode_returns], np.float64)
  returns = np.array([value for _, value in episode_returns], np.float64)
  figure = Figure(figsize=(6, 3.5))
  axes = figure.subplots()
  axes.scatter(steps, returns, s=2, color=color, alpha=0.2,
               label="one episode")
  if steps.size:
    edges = np.linspace(0, steps.max() + 1, num_points + 1)
    window = np.digitize(steps, edges) - 1
    counts = np.bincount(window, minlength=num_points)[:num_points]
    sums = np.bincount(window, returns, minlength=num_points)[:num_points]
    centres = (edges[:-1] + edges[1:]) / 2
    ended = counts > 0
    axes.plot(centres[ended], sums[ended] / counts[ended], color=color,
              label=f"mean over windows of {edges[1]:,.0f} env steps")
  axes.set(xlabel="env steps", ylabel="episodic return", title=title)
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def parse_config(config_type: type, description: str,
                 argv: list[str] | None = None) -> tuple[Any, str | None]:
  """`config_type(...)` from one flag per field, and the `--plot` path.

  A field `learning_rate` is the flag `--learning-rate`; a bool field
  `double_q` is the pair `--double-q` / `--no-double-q`, since
  `type=bool` would read any non-empty string, "False" included, as True.
  """
  parser = argparse.ArgumentParser(description=description)
  for field in dataclasses.fields(config_type):
    flag = "--" + field.name.replace("_", "-")
    if field.type is bool:
      parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                          default=field.default)
    else:
      parser.add_argument(flag, type=field.type, default=field.default)
  parser.add_argument("--plot", default=None,
                      help="save the learning curve to this image file")
  args = vars(parser.parse_args(argv))
  plot = args.pop("plot")
  return config_type(**args), plot


def main(argv: list[str] | None, *, config_type: type,
         train: Callable[[Any], dict[str, Any]], description: str,
         plot_title: Callable[[Any], str], plot_color: str) -> None:
  """Parses the flags, trains, prints the speed and returns, maybe plots.

  The last line printed is always `final mean return: X`, which
  tests/test_examples.py reads.
  """
  config, plot = parse_config(config_type, description, argv)
  result = train(config)
  print(f"env steps per second: {result['steps_per_second']:,.0f} "
        f"({config.num_seeds} seed(s) x {config.num_envs} envs, "
        f"{result['env_steps_per_seed']:,} steps per seed; "
        f"compilation {result['compile_seconds']:.1f} s, not counted)")
  print("final return per seed: "
        + " ".join(f"{r:.1f}" for r in result["final_returns"]))
  if plot:
    plot_learning_curve(result, plot, plot_title(config), plot_color)
  print(f"final mean return: {result['final_mean_return']:.1f}")
