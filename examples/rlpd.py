"""RLPD-style TD3 on Pendulum: half of every batch from an offline dataset.

Shape key: K seeds, S sample size, N envs, I iterations.

RLPD (Ball et al., ICML 2023) starts online training with a dataset at
hand and draws every batch half from the dataset and half from the online
replay ("symmetric sampling"), with LayerNorm in the critics; it learns in a
fraction of the steps an agent from scratch needs. Here:

1. Record: a medium policy runs gymnasium's Pendulum-v1 under Minari's
   `DataCollector`, which writes the dataset to disk (MINARI_DATASETS_PATH, a
   scratch folder unless set). The policy is a scripted swing-up (pump
   energy, then a PD controller at the top: returns about -140) that takes
   a uniformly random torque with probability `behaviour_noise` (0.5:
   returns about -550, where random torques get -1200).
2. Load: `jaxbuf.from_minari` streams it into a uniform replay buffer of
   `jaxbuf.Transition`s.
3. Train online: TD3 (Fujimoto et al. 2018) with LayerNorm critics, on
   gymnax's Pendulum-v1 (the same dynamics, in JAX), 4 updates per env step
   (RLPD's point is a high update-to-data ratio, where data, not updates,
   limits learning; at 1 update per step online-only kept pace). Every
   batch comes from `jaxbuf.mixture([offline, online],
   [offline_fraction, 1 - offline_fraction])`: 0.5 is RLPD's symmetric
   sampling, 0 is online-only from scratch, the same code with the
   dataset's part given no rows. Env steps, adds, the mixed sample and the
   updates of K seeds run in one jitted, vmapped `lax.scan`.

Why Pendulum: it runs in gymnax (pure JAX, so the whole loop fuses) and
learns within tens of thousands of steps on a 2-core CPU, where MuJoCo
locomotion needs about a million.

The bar, printed at the end (and held by `pytest -m slow`): the mean over
seeds of mixing's learning curve (episodic returns in windows of 500 steps)
reaches online-only's final return (its mean over the last 10% of steps)
by the end of a window within half the env steps.

Measured (3 seeds, 10,000 env steps each, the defaults; 2026-11-26, 2-core
CPU shared with other work, about 5 minutes a run): dataset mean return
-489; mixing reaches online-only's final -154.5 at 4,000 env steps, online
only itself at 4,500; mean curves at 2,000 / 2,500 / 3,000 / 3,500 / 4,000
steps: mixing -815 -572 -459 -192 -142, online only -948 -905 -260 -239
-239. With `--seed 1` (another dataset, mean -483): mixing reaches
online-only's final -177.4 at 3,500 steps, online only at 5,500; at 2,000
/ 2,500 / 3,000 / 3,500 / 4,000 steps mixing -693 -419 -634 -167 -129,
online only -1002 -742 -511 -261 -277.
Pendulum is easy: both end near -150 to -180, the swing-up's level, and the
data buys about 500 to 2,000 steps of a 4,000 to 5,500 step climb.

  python examples/rlpd.py                     # both runs, 3 seeds, the bar
  python examples/rlpd.py --plot rlpd.png     # and both learning curves
"""

import dataclasses
import os
import pathlib
import sys
import tempfile
import time
import warnings
from typing import Any

import flax.linen as nn
import flax.struct
import gymnasium
import gymnax
import jax
import jax.numpy as jnp
import minari
import numpy as np
import optax

if __package__ in (None, ""):
  # Run as a script: the checkout goes first on the path (examples/dqn.py).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import training  # noqa: E402

MAX_TORQUE = 2.0  # Pendulum-v1's action bound


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""

  dataset_steps: int = 10_000  # env steps recorded (50 episodes)
  behaviour_noise: float = 0.5  # medium policy: random torque probability
  offline_fraction: float = 0.5  # the run compared: its share of a batch
  num_seeds: int = 3  # K, vmapped
  seed: int = 0
  total_steps: int = 10_000  # env steps per seed and run
  learning_starts: int = 500  # random actions, no updates, before
  buffer_size: int = 100_000  # online replay
  batch_size: int = 128
  learning_rate: float = 3e-4
  gamma: float = 0.99
  tau: float = 0.005  # target networks' soft update
  exploration_noise: float = 0.1  # x MAX_TORQUE, Gaussian
  policy_noise: float = 0.2  # TD3's target smoothing, x MAX_TORQUE
  noise_clip: float = 0.5  # x MAX_TORQUE
  policy_delay: int = 2
  updates_per_step: int = 4  # UTD: updates per env step (RLPD's
  # point: many updates, data the limit)
  hidden_size: int = 64
  num_chunks: int = 10
  curve_points: int = 20


class Actor(nn.Module):
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> jax.Array:
    x = nn.relu(nn.Dense(self.hidden_size)(obs))
    x = nn.relu(nn.Dense(self.hidden_size)(x))
    return MAX_TORQUE * jnp.tanh(nn.Dense(1)(x))


class TwinCritic(nn.Module):
  """Two Q-networks `(obs [..., 3], action [..., 1]) -> [2, ...]`, LayerNorm
  after each hidden layer (RLPD's guard against values extrapolated far
  from the data)."""

  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
    values = []
    for _ in range(2):
      x = jnp.concatenate([obs, action], axis=-1)
      for _ in range(2):
        x = nn.relu(nn.LayerNorm()(nn.Dense(self.hidden_size)(x)))
      values.append(nn.Dense(1)(x)[..., 0])
    return jnp.stack(values)


@flax.struct.dataclass
class Networks:
  """TD3's parameters, target parameters and optimizer states."""

  actor: Any
  critic: Any
  actor_target: Any
  critic_target: Any
  actor_opt: Any
  critic_opt: Any


@flax.struct.dataclass
class RunnerState:
  nets: Networks
  buffer_states: list  # [offline, online]: the mixture's states
  env_state: Any
  obs: jax.Array  # [N, 3] float32
  episode_returns: jax.Array  # [N] float32
  iteration: jax.Array  # (), int32
  key: jax.Array


def scripted_torque(obs: np.ndarray) -> float:
  """Swing-up by energy pumping, a PD controller near the top.

  With theta 0 upright, Pendulum's dynamics are theta'' = 15 sin(theta) +
  3 u, so E = theta'^2 / 2 + 15 (cos(theta) - 1) is 0 upright at rest and
  dE/dt = 3 u theta': torque along theta' pumps energy in.
  """
  cos, sin, velocity = (float(value) for value in obs)
  angle = np.arctan2(sin, cos)
  if cos > 0.85:
    return float(np.clip(-(10 * angle + 2 * velocity), -MAX_TORQUE, MAX_TORQUE))
  energy = 0.5 * velocity**2 + 15 * (cos - 1)
  if energy < 0:
    return float(np.clip(-5 * energy * velocity, -MAX_TORQUE, MAX_TORQUE))
  return float(np.clip(-velocity, -MAX_TORQUE, MAX_TORQUE))


def record(dataset_id: str, config: Config) -> minari.MinariDataset:
  """Runs the medium policy in gymnasium under Minari's DataCollector."""
  env = minari.DataCollector(gymnasium.make("Pendulum-v1"))
  rng = np.random.default_rng(config.seed)
  obs, _ = env.reset(seed=config.seed)
  for _ in range(config.dataset_steps):
    torque = (
      rng.uniform(-MAX_TORQUE, MAX_TORQUE)
      if rng.random() < config.behaviour_noise
      else scripted_torque(obs)
    )
    obs, _, terminated, truncated, _ = env.step(np.array([torque], np.float32))
    if terminated or truncated:
      # Seeded: Minari's DataCollector seeds an unseeded reset from
      # `secrets`, and the dataset would differ between recordings.
      obs, _ = env.reset(seed=int(rng.integers(2**31)))
  dataset = env.create_dataset(
    dataset_id,
    algorithm_name=f"scripted swing-up, noise {config.behaviour_noise}",
    author="jaxbuf examples",
    author_email="-",
    code_permalink="-",
    description="Pendulum-v1, a medium policy",
  )
  env.close()
  return dataset


def load_offline(config: Config) -> tuple[jaxbuf.Buffer, Any, dict[str, Any]]:
  """The dataset (recorded once per settings) in a uniform replay buffer."""
  dataset_id = (
    f"pendulum/medium-noise{int(config.behaviour_noise * 100)}-"
    f"seed{config.seed}-steps{config.dataset_steps}-v0"
  )
  with warnings.catch_warnings():
    # Minari warns that this dataset has no eval_env or versioned code.
    warnings.simplefilter("ignore", UserWarning)
    try:
      dataset = minari.load_dataset(dataset_id)
    except FileNotFoundError:
      dataset = record(dataset_id, config)
  buffer = jaxbuf.uniform_replay(dataset.total_steps)
  # Minari keeps gymnasium's float64 rewards; the buffer holds float32 (in
  # 64-bit mode too, where the dataset's example would keep float64).
  example = training.as_float32(jaxbuf.offline_example(dataset, buffer))
  state = jaxbuf.from_minari(dataset, buffer, buffer.init(example), round_floats=True)
  returns = [episode.rewards.sum() for episode in dataset.iterate_episodes()]
  return (
    buffer,
    state,
    dict(
      dataset_mean_return=float(np.mean(returns)),
      dataset_episodes=dataset.total_episodes,
      dataset_steps=dataset.total_steps,
    ),
  )


def make_trainer(config: Config, offline: jaxbuf.Buffer, offline_state: Any) -> training.Trainer:
  """One seed's TD3 with batches mixed from `offline` and online replay."""
  env, env_params = gymnax.make("Pendulum-v1")
  online = jaxbuf.uniform_replay(config.buffer_size)
  mixture = jaxbuf.mixture(
    [offline, online], [config.offline_fraction, 1 - config.offline_fraction]
  )
  actor, critic = Actor(config.hidden_size), TwinCritic(config.hidden_size)
  optimizer = optax.adam(config.learning_rate)
  example = jax.tree.map(lambda leaf: leaf[0], offline_state.storage)

  def init(key: jax.Array) -> RunnerState:
    key, actor_key, critic_key, reset_key = jax.random.split(key, 4)
    obs, env_state = env.reset(reset_key, env_params)
    actor_params = actor.init(actor_key, example.obs)
    critic_params = critic.init(critic_key, example.obs, example.action)
    return RunnerState(
      nets=Networks(
        actor=actor_params,
        critic=critic_params,
        actor_target=actor_params,
        critic_target=critic_params,
        actor_opt=optimizer.init(actor_params),
        critic_opt=optimizer.init(critic_params),
      ),
      buffer_states=[offline_state, online.init(example)],
      env_state=env_state,
      obs=training.as_float32(obs)[None],
      episode_returns=jnp.zeros(1, jnp.float32),
      iteration=jnp.zeros((), jnp.int32),
      key=key,
    )

  def critic_loss(critic_params, nets, batch, key):
    noise = jnp.clip(
      config.policy_noise * MAX_TORQUE * jax.random.normal(key, batch.action.shape, jnp.float32),
      -config.noise_clip * MAX_TORQUE,
      config.noise_clip * MAX_TORQUE,
    )
    next_action = jnp.clip(
      actor.apply(nets.actor_target, batch.next_obs) + noise, -MAX_TORQUE, MAX_TORQUE
    )
    next_q = critic.apply(nets.critic_target, batch.next_obs, next_action).min(axis=0)
    # Pendulum only truncates: every transition bootstraps.
    bootstrap = config.gamma * (1.0 - batch.terminated.astype(jnp.float32))
    target = jax.lax.stop_gradient(batch.reward + bootstrap * next_q)
    q = critic.apply(critic_params, batch.obs, batch.action)
    return jnp.mean((q - target[None]) ** 2)

  def actor_loss(actor_params, critic_params, batch):
    action = actor.apply(actor_params, batch.obs)
    return -jnp.mean(critic.apply(critic_params, batch.obs, action)[0])

  def update(nets: Networks, buffer_states: list, key: jax.Array, count: jax.Array) -> Networks:
    """One TD3 update on a mixed batch; the actor and the targets every
    `policy_delay` updates (`count` numbers the updates)."""
    sample_key, noise_key = jax.random.split(key)
    batch = mixture.sample(buffer_states, sample_key, config.batch_size).items
    grads = jax.grad(critic_loss)(nets.critic, nets, batch, noise_key)
    updates, critic_opt = optimizer.update(grads, nets.critic_opt)
    nets = nets.replace(critic=optax.apply_updates(nets.critic, updates), critic_opt=critic_opt)

    def improve_actor(nets):
      grads = jax.grad(actor_loss)(nets.actor, nets.critic, batch)
      updates, actor_opt = optimizer.update(grads, nets.actor_opt)
      actor_params = optax.apply_updates(nets.actor, updates)
      return nets.replace(
        actor=actor_params,
        actor_opt=actor_opt,
        actor_target=optax.incremental_update(actor_params, nets.actor_target, config.tau),
        critic_target=optax.incremental_update(nets.critic, nets.critic_target, config.tau),
      )

    return jax.lax.cond(count % config.policy_delay == 0, improve_actor, lambda nets: nets, nets)

  def learn(state: RunnerState, key: jax.Array) -> RunnerState:
    """`updates_per_step` updates; the replay storage is only read."""

    def one(nets, key_and_count):
      return update(nets, state.buffer_states, *key_and_count), None

    counts = state.iteration * config.updates_per_step + jnp.arange(config.updates_per_step)
    nets, _ = jax.lax.scan(
      one, state.nets, (jax.random.split(key, config.updates_per_step), counts)
    )
    return state.replace(nets=nets)

  def step(state: RunnerState) -> tuple[RunnerState, training.Metrics]:
    key, noise_key, random_key, env_key, learn_key = jax.random.split(state.key, 5)
    explore = jnp.clip(
      actor.apply(state.nets.actor, state.obs)
      + config.exploration_noise * MAX_TORQUE * jax.random.normal(noise_key, (1, 1), jnp.float32),
      -MAX_TORQUE,
      MAX_TORQUE,
    )
    uniform = jax.random.uniform(
      random_key, (1, 1), jnp.float32, minval=-MAX_TORQUE, maxval=MAX_TORQUE
    )
    action = jnp.where(state.iteration < config.learning_starts, uniform, explore)
    # gymnax computes in JAX's default float dtype (float64 in 64-bit mode)
    # and keeps the torque in its state: it gets the torque in that dtype.
    torque = action[0].astype(state.env_state.last_u.dtype)
    obs, env_state, reward, terminated, truncated, info = env.step(
      env_key, state.env_state, torque, env_params
    )
    reward = training.as_float32(reward)[None]
    terminated, truncated = terminated[None], truncated[None]
    offline_state, online_state = state.buffer_states
    online_state = online.add(
      online_state,
      jaxbuf.Transition(
        obs=state.obs,
        action=action,
        reward=reward,
        next_obs=training.as_float32(info["final_observation"])[None],
        terminated=terminated,
        truncated=truncated,
      ),
    )
    episode_returns = state.episode_returns + reward
    ended = terminated | truncated
    state = state.replace(
      buffer_states=[offline_state, online_state],
      env_state=env_state,
      obs=training.as_float32(obs)[None],
      episode_returns=jnp.where(ended, 0.0, episode_returns),
      key=key,
    )
    # Vmapped over seeds, a cond is a select of every output: cond_update
    # keeps the replay storage, which learning only reads, out of it.
    state = jaxbuf.cond_update(
      state.iteration >= config.learning_starts, learn, lambda state, key: state, state, learn_key
    )
    state = state.replace(iteration=state.iteration + 1)
    return state, training.episode_metrics(ended, episode_returns, jnp.zeros((), jnp.float32))

  title = "TD3, " + ("mixing" if config.offline_fraction else "online only")
  return training.Trainer(init=init, step=step, env_steps_per_iteration=1, title=title)


def mean_curve(result: dict[str, Any], points: int) -> tuple[np.ndarray, np.ndarray]:
  """Env steps at the end of each window `[P]`, and the seeds' mean return
  in it `[P]`."""
  iterations, curves = training.learning_curve(
    result["returns_sum"], result["episodes_ended"], points
  )
  window = 2 * iterations[0]
  return iterations + window / 2, np.nanmean(curves, axis=0)


def run(
  config: Config, datasets_path: str | None = None, show_progress: bool = True
) -> dict[str, Any]:
  """Records or reads the dataset, trains mixing and online-only on K seeds
  each; the curves, final returns and the bar."""
  if datasets_path is not None:
    os.environ["MINARI_DATASETS_PATH"] = datasets_path
  start = time.perf_counter()
  offline, offline_state, results = load_offline(config)
  results["load_seconds"] = time.perf_counter() - start
  runs = {"mixing": config, "online only": dataclasses.replace(config, offline_fraction=0.0)}
  for name, run_config in runs.items():
    trained = training.train(
      make_trainer(run_config, offline, offline_state), run_config, show_progress=show_progress
    )
    steps, curve = mean_curve(trained, config.curve_points)
    results[name] = dict(trained, curve_steps=steps, curve=curve)
  target = results["online only"]["final_mean_return"]
  mixing = results["mixing"]

  def first_reaching(curve_steps, curve):
    reached = np.flatnonzero(curve >= target)
    return float(curve_steps[reached[0]]) if reached.size else None

  results["steps_to_online_final"] = first_reaching(mixing["curve_steps"], mixing["curve"])
  # For reference: when online-only's own curve first got there.
  results["online_steps_to_online_final"] = first_reaching(
    results["online only"]["curve_steps"], results["online only"]["curve"]
  )
  reached = np.flatnonzero(mixing["curve"] >= target)
  results["bar_met"] = bool(
    reached.size and results["steps_to_online_final"] <= config.total_steps / 2
  )
  return results


def plot_curves(results: dict[str, Any], path: str) -> None:
  """Saves both runs' mean learning curves (and each seed, faint) to `path`."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  figure = Figure(figsize=(6, 3.5))
  axes = figure.subplots()
  for name, color in (("mixing", "tab:red"), ("online only", "tab:gray")):
    result = results[name]
    _, seeds = training.learning_curve(
      result["returns_sum"], result["episodes_ended"], len(result["curve"])
    )
    for curve in seeds:
      axes.plot(result["curve_steps"], curve, color=color, alpha=0.25, linewidth=1)
    axes.plot(
      result["curve_steps"],
      result["curve"],
      color=color,
      label=f"{name}, mean of {len(seeds)} seeds",
    )
  axes.axhline(
    results["dataset_mean_return"], color="black", linestyle="--", label="dataset mean return"
  )
  axes.set(
    xlabel="env steps per seed",
    ylabel="episodic return",
    title="TD3 on Pendulum-v1: 50/50 offline data vs online only",
  )
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  config, plot = training.parse_config(Config, __doc__.splitlines()[0], argv)
  with tempfile.TemporaryDirectory() as scratch:
    results = run(config, os.environ.get("MINARI_DATASETS_PATH", scratch))
  print(
    f"dataset: {results['dataset_episodes']} episodes, "
    f"{results['dataset_steps']} steps, mean return "
    f"{results['dataset_mean_return']:.1f}"
  )
  for name in ("mixing", "online only"):
    result = results[name]
    print(
      f"{name}: final return per seed "
      + " ".join(f"{r:.1f}" for r in result["final_returns"])
      + f"; mean curve ({len(result['curve'])} windows of "
      f"{config.total_steps // len(result['curve'])} steps): "
      + " ".join(f"{r:.0f}" for r in result["curve"])
    )
  steps = results["steps_to_online_final"]
  online_steps = results["online_steps_to_online_final"]
  print(
    f"online only first reaches its final return at "
    f"{'never' if online_steps is None else f'{online_steps:,.0f}'} env "
    f"steps (each run: the end of the first window whose mean return "
    f"gets there)"
  )
  print(
    f"mixing reaches online-only's final return "
    f"{results['online only']['final_mean_return']:.1f} at "
    f"{'never' if steps is None else f'{steps:,.0f}'} env steps of "
    f"{config.total_steps:,}; bar (at most half): "
    f"{'met' if results['bar_met'] else 'NOT met'}"
  )
  if plot:
    plot_curves(results, plot)
  return results


if __name__ == "__main__":
  main()
