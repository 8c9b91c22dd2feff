"""How every example runs: flags, envs, seeds vmapped in chunks, curves, plots.

Shape key: K seeds, N envs, I iterations (a DQN vectorized env step, a PPO
update), P points of a learning curve.

An example builds a `Trainer` (`init(key) -> state`,
`step(state) -> (state, Metrics)`, its own state type) and `train` vmaps it
over K seeds and runs it as a few jitted chunks of a `lax.scan`, so the host
only sees the program between chunks to move the progress bar. Each
script's `Config` dataclass doubles as its command line (`parse_config`);
`main` parses it, trains, prints the speed and the returns and plots.
"""

import argparse
import dataclasses
import time
from typing import Any, Callable, NamedTuple

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import tqdm


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The flags of a run of K seeds vmapped; each example's `Config` extends it."""

  total_steps: int = 500_000  # env steps per seed
  num_seeds: int = 1  # K seeds trained at once with vmap
  seed: int = 0
  num_envs: int = 10  # N
  num_chunks: int = 50  # progress-bar updates (one jitted call each)


@dataclasses.dataclass(frozen=True)
class GymnaxConfig(RunConfig):
  """A run on a gymnax environment."""

  env_name: str = "CartPole-v1"
  time_limit: int = 0  # episode step limit; 0 keeps the env's own


class Metrics(NamedTuple):
  """Per-iteration statistics; sums, so the host can average over any window."""

  returns_sum: jax.Array  # (), float32: summed returns of episodes ended now
  episodes_ended: jax.Array  # (), float32
  loss: jax.Array  # (), float32 (0 before learning starts)


def episode_metrics(
  episode_ended: jax.Array, episode_returns: jax.Array, loss: jax.Array
) -> Metrics:
  """The metrics of one iteration from `episode_ended` and the returns `[N]`."""
  return Metrics(
    returns_sum=jnp.sum(jnp.where(episode_ended, episode_returns, 0.0)),
    episodes_ended=jnp.sum(episode_ended.astype(jnp.float32)),
    loss=loss,
  )


class Trainer(NamedTuple):
  """One seed's training: pure functions to vmap over seeds, and its labels."""

  init: Callable[[jax.Array], Any]  # key -> the example's state
  step: Callable[[Any], tuple[Any, Metrics]]  # state -> (state, metrics)
  env_steps_per_iteration: int  # of one seed in one `step`
  title: str  # progress bar and plot


class EnvStep(NamedTuple):
  """What `VectorEnv.step` returns, leaves `[N, ...]`."""

  obs: jax.Array  # float32, after gymnax's auto-reset: an ended
  # episode's env shows the next one's first
  env_state: Any
  reward: jax.Array  # float32
  terminated: jax.Array  # bool: a true end of episode, no bootstrap
  truncated: jax.Array  # bool: cut by the time limit
  final_obs: jax.Array  # float32: the observation the step reached, before
  # any auto-reset (gymnax's info["final_observation"])

  @property
  def ended(self) -> jax.Array:
    """`[N]` bool: the episode ended at this step, either way."""
    return self.terminated | self.truncated


class VectorEnv(NamedTuple):
  """N copies of a gymnax environment; reset and step split their key N ways.

  Floating-point observations, rewards and `info` leaves come out float32
  whatever JAX's default dtypes (see `as_float32`); the env state keeps
  gymnax's own dtypes, since only gymnax reads it.
  """

  num_actions: int
  # key -> (obs [N, *obs_shape] float32, env_state with leaves [N, ...])
  reset: Callable[[jax.Array], tuple[jax.Array, Any]]
  # (key, env_state, actions [N]) -> EnvStep, gymnax's step with auto-reset.
  step: Callable[[jax.Array, Any, jax.Array], EnvStep]


def as_float32(tree: Any) -> Any:
  """`tree` with its floating-point leaves cast to float32, others kept.

  gymnax computes in JAX's default float dtype, float64 once
  `JAX_ENABLE_X64` is set. The examples' networks, buffers and `lax.cond`
  branches hold float32, and jaxbuf refuses a float64 leaf for float32
  storage rather than cast it silently, so values are cast where they leave
  the environment. Under 32-bit defaults this is a no-op.
  """
  return jax.tree.map(
    lambda leaf: leaf.astype(jnp.float32) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf,
    tree,
  )


def position_and_angle(cartpole_obs: jax.Array) -> jax.Array:
  """CartPole's `(x, x_dot, theta, theta_dot)` `[..., 4]` without its
  velocities `[..., 2]`: a partially observed task."""
  return cartpole_obs[..., jnp.array((0, 2))]


def make_vector_env(
  env_name: str,
  time_limit: int,
  num_envs: int,
  observe: Callable[[jax.Array], jax.Array] | None = None,
) -> VectorEnv:
  """`num_envs` vmapped copies of `gymnax.make(env_name)`.

  `time_limit`, unless 0, replaces the env's episode step limit.
  `observe`, if given, maps every observation the envs return, the final
  observations included (e.g. `position_and_angle`).
  """
  env, env_params = gymnax.make(env_name)
  if time_limit:
    env_params = env_params.replace(max_steps_in_episode=time_limit)
  observe = observe or (lambda obs: obs)
  vmapped_reset = jax.vmap(env.reset, in_axes=(0, None))
  vmapped_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

  def reset(key: jax.Array) -> tuple[jax.Array, Any]:
    obs, env_state = vmapped_reset(jax.random.split(key, num_envs), env_params)
    return observe(as_float32(obs)), env_state

  def step(key: jax.Array, env_state: Any, actions: jax.Array) -> EnvStep:
    obs, env_state, reward, terminated, truncated, info = vmapped_step(
      jax.random.split(key, num_envs), env_state, actions, env_params
    )
    return EnvStep(
      obs=observe(as_float32(obs)),
      env_state=env_state,
      reward=as_float32(reward),
      terminated=terminated,
      truncated=truncated,
      final_obs=observe(as_float32(info["final_observation"])),
    )

  return VectorEnv(num_actions=env.action_space(env_params).n, reset=reset, step=step)


def make_chunk_runner(step: Callable, iterations_per_chunk: int) -> Callable:
  """`states [K, ...] -> (states, metrics [K, iterations_per_chunk])`, jitted.

  The states are donated, so the K replay buffers or rollout storages are
  updated in place from one chunk to the next rather than copied.
  """

  def run_chunk(state):
    return jax.lax.scan(lambda carry, _: step(carry), state, None, length=iterations_per_chunk)

  return jax.jit(jax.vmap(run_chunk), donate_argnums=0)


def train(trainer: Trainer, config: RunConfig, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds of `trainer` at once; metrics and timings.

  `config.total_steps` env steps per seed, rounded down to whole chunks of
  iterations, in `config.num_chunks` jitted calls (one progress-bar update
  each, at most one per iteration). `show_progress=False` hides the bar
  (tests, notebooks).

  Returns:
    A dict: "returns_sum" and "episodes_ended" float `[K, I]` per iteration,
    "env_steps_per_iteration", "steps_per_second" (env steps of all seeds
    together per second of the training loop, compilation excluded),
    "env_steps_per_seed" (env steps of whole chunks), "compile_seconds",
    "final_mean_return" (mean episodic return over the last 10% of
    iterations, averaged over seeds), "final_returns" `[K]` and "title".
  """
  num_seeds = config.num_seeds
  num_iterations = config.total_steps // trainer.env_steps_per_iteration
  num_chunks = max(min(config.num_chunks, num_iterations), 1)
  iterations_per_chunk = max(num_iterations // num_chunks, 1)
  run_chunk = make_chunk_runner(trainer.step, iterations_per_chunk)

  env_steps_per_chunk = iterations_per_chunk * trainer.env_steps_per_iteration
  total_env_steps = num_chunks * env_steps_per_chunk * num_seeds
  # Counts the env steps of all seeds, like the steps per second printed.
  progress = tqdm.tqdm(
    total=total_env_steps,
    unit=" env steps",
    unit_scale=True,
    disable=not show_progress,
    desc=f"{trainer.title}, {num_seeds} seed(s)",
  )
  # Shown from the start: compiling the recurrent examples takes long enough
  # that a silent terminal looks hung.
  progress.set_postfix_str("compiling")
  seeds = jax.random.split(jax.random.key(config.seed), num_seeds)
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
  return dict(
    returns_sum=returns_sum,
    episodes_ended=episodes_ended,
    env_steps_per_iteration=trainer.env_steps_per_iteration,
    env_steps_per_seed=total_env_steps // num_seeds,
    steps_per_second=total_env_steps / loop_seconds,
    compile_seconds=compile_seconds,
    final_returns=final_returns,
    final_mean_return=float(final_returns.mean()),
    title=trainer.title,
  )


def tail_mean_return(
  returns_sum: np.ndarray, episodes_ended: np.ndarray, fraction: float = 0.1
) -> np.ndarray:
  """Mean episodic return per seed over the last `fraction` of iterations `[K]`."""
  tail = max(int(returns_sum.shape[1] * fraction), 1)
  return returns_sum[:, -tail:].sum(axis=1) / np.maximum(episodes_ended[:, -tail:].sum(axis=1), 1)


def learning_curve(
  returns_sum: np.ndarray, episodes_ended: np.ndarray, num_points: int = 50
) -> tuple[np.ndarray, np.ndarray]:
  """Mean episodic return per seed in equal windows: `[P]`, `[K, P]`."""
  num_points = min(num_points, returns_sum.shape[1])
  num_iterations = returns_sum.shape[1] // num_points * num_points
  window = num_iterations // num_points
  sums = returns_sum[:, :num_iterations].reshape(-1, num_points, window).sum(-1)
  counts = episodes_ended[:, :num_iterations].reshape(-1, num_points, window).sum(-1)
  centres = (np.arange(num_points) + 0.5) * window
  return centres, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_learning_curve(result: dict[str, Any], path: str) -> None:
  """Saves each seed's curve (faint) and their mean to `path`."""
  from matplotlib.figure import Figure  # no pyplot: no GUI backend needed

  iterations, curves = learning_curve(result["returns_sum"], result["episodes_ended"])
  seeds_with_episodes = np.sum(~np.isnan(curves), axis=0)
  mean_curve = np.where(
    seeds_with_episodes > 0, np.nansum(curves, axis=0) / np.maximum(seeds_with_episodes, 1), np.nan
  )
  env_steps = iterations * result["env_steps_per_iteration"]
  figure = Figure(figsize=(6, 3.5))
  axes = figure.subplots()
  for curve in curves:
    axes.plot(env_steps, curve, color="tab:blue", alpha=0.3, linewidth=1)
  axes.plot(
    env_steps,
    mean_curve,
    color="tab:blue",
    label=(f"mean of {len(curves)} seeds" if len(curves) > 1 else "1 seed"),
  )
  axes.set(xlabel="env steps per seed", ylabel="episodic return", title=result["title"])
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)


class EpisodeReturns:
  """Returns of the episodes that ended, tallied on the host by the
  host-stepped examples (gymnasium, ALE)."""

  def __init__(self, num_envs: int):
    self.running = np.zeros(num_envs)
    self.ended: list[tuple[int, float]] = []  # (env step, return)

  def record(self, env_step: int, rewards: np.ndarray, ended: np.ndarray) -> None:
    self.running += rewards
    self.ended += [(env_step, r) for r in self.running[ended]]
    self.running[ended] = 0.0

  def mean_since(self, env_step: int) -> float:
    recent = [r for step, r in self.ended if step >= env_step]
    return float(np.mean(recent)) if recent else float("nan")

  def plot(self, path: str, title: str, num_points: int = 50) -> None:
    """Saves each episode's return (faint dots, at the env step it ended)
    and their mean over `num_points` equal windows of env steps to `path`."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend needed

    steps = np.array([step for step, _ in self.ended], np.float64)
    returns = np.array([value for _, value in self.ended], np.float64)
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    axes.scatter(steps, returns, s=2, color="tab:blue", alpha=0.2, label="one episode")
    if steps.size:
      edges = np.linspace(0, steps.max() + 1, num_points + 1)
      window = np.digitize(steps, edges) - 1
      counts = np.bincount(window, minlength=num_points)[:num_points]
      sums = np.bincount(window, returns, minlength=num_points)[:num_points]
      centres = (edges[:-1] + edges[1:]) / 2
      ended = counts > 0
      axes.plot(
        centres[ended],
        sums[ended] / counts[ended],
        color="tab:blue",
        label=f"mean over windows of {edges[1]:,.0f} env steps",
      )
    axes.set(xlabel="env steps", ylabel="episodic return", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def parse_config(
  config_type: type, description: str, argv: list[str] | None = None
) -> tuple[Any, str | None]:
  """`config_type(...)` from one flag per field, and the `--plot` path.

  A field `learning_rate` is the flag `--learning-rate`; a bool field
  `double_q` is the pair `--double-q` / `--no-double-q`, since
  `type=bool` would read any non-empty string, "False" included, as True.
  """
  parser = argparse.ArgumentParser(description=description)
  for field in dataclasses.fields(config_type):
    flag = "--" + field.name.replace("_", "-")
    if field.type is bool:
      parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
    else:
      parser.add_argument(flag, type=field.type, default=field.default)
  parser.add_argument("--plot", default=None, help="save the learning curve to this image file")
  args = vars(parser.parse_args(argv))
  plot = args.pop("plot")
  return config_type(**args), plot


def main(
  argv: list[str] | None,
  config_type: type,
  train_fn: Callable[[Any], dict[str, Any]],
  description: str,
  report: Callable[[Any, dict[str, Any]], None] | None = None,
) -> None:
  """Parses the flags, trains, prints the speed and returns, maybe plots.

  `report(config, result)`, if given, prints the example's own lines. The
  last line printed is always `final mean return: X`, which
  tests/test_examples.py reads.
  """
  config, plot = parse_config(config_type, description, argv)
  result = train_fn(config)
  print(
    f"env steps per second: {result['steps_per_second']:,.0f} "
    f"({config.num_seeds} seed(s) x {config.num_envs} envs, "
    f"{result['env_steps_per_seed']:,} steps per seed; "
    f"compilation {result['compile_seconds']:.1f} s, not counted)"
  )
  print("final return per seed: " + " ".join(f"{r:.1f}" for r in result["final_returns"]))
  if report is not None:
    report(config, result)
  if plot:
    plot_learning_curve(result, plot)
  print(f"final mean return: {result['final_mean_return']:.1f}")
