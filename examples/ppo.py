"""PPO on a gymnax environment with jaxbuf rollouts, GAE and minibatches, jitted.

Shape key: K seeds, T rollout length, N envs, M minibatches, L sequence
length, E sequences per minibatch, A actions, H hidden size.

One PPO update is one pure function: T steps of N vmapped environments
written into a `jaxbuf.rollout_buffer`, `jaxbuf.compute_gae`, then epochs of
shuffled minibatches, each an optax step. Updates are chained with `lax.scan`
and K seeds train at once with `vmap`. With `--recurrent gru` or `lstm` the
policy carries a flax recurrent state; the update then cuts each env's column
into sequences of L steps (`jaxbuf.sequence_chunks`) and re-runs the policy
from the hidden state stored at each sequence's first step.

  python examples/ppo.py                       # the demo: 5e5 steps, one seed
  python examples/ppo.py --num-seeds 4 --plot ppo.png   # the learning bar
  python examples/ppo.py --recurrent gru       # a GRU policy, sequence minibatches

Truncation: gymnax resets inside `env.step`; the observation it replaced is
`info["final_observation"]`. A step cut off by the time limit (CartPole-v1:
500 steps) is stored as `truncated` with `truncated_value` = V(that final
observation), so GAE bootstraps from it instead of treating the time limit
as a failure. A step both terminated and truncated counts as terminated.
"""

import argparse
import dataclasses
import time
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import flax.struct
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import jaxbuf

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  env_name: str = "CartPole-v1"
  time_limit: int = 0                 # episode step limit; 0 keeps the env's own
  total_steps: int = 500_000          # env steps per seed
  num_seeds: int = 1                  # K seeds trained at once with vmap
  seed: int = 0
  num_envs: int = 4                   # N
  num_steps: int = 128                # T, steps per env per update
  update_epochs: int = 4
  num_minibatches: int = 4            # M
  learning_rate: float = 2.5e-4       # annealed linearly to 0
  gamma: float = 0.99
  gae_lambda: float = 0.95
  clip_eps: float = 0.2
  entropy_coef: float = 0.01
  value_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden_size: int = 64
  recurrent: str = "none"             # "none", "gru" or "lstm"
  sequence_length: int = 32           # L, recurrent minibatch sequences
  num_chunks: int = 50                # progress-bar updates (one jitted call each)


class ActorCritic(nn.Module):
  """Separate tanh MLPs: observations `[..., D]` -> logits `[..., A]`, value `[...]`."""
  num_actions: int
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
    actor = nn.tanh(nn.Dense(self.hidden_size)(obs))
    actor = nn.tanh(nn.Dense(self.hidden_size)(actor))
    logits = nn.Dense(self.num_actions,
                      kernel_init=nn.initializers.orthogonal(0.01))(actor)
    critic = nn.tanh(nn.Dense(self.hidden_size)(obs))
    critic = nn.tanh(nn.Dense(self.hidden_size)(critic))
    value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic)
    return logits, value[..., 0]


class RecurrentActorCritic(nn.Module):
  """One step of a GRU/LSTM policy for E streams.

  `(hidden, obs [E, D], episode_start [E]) -> (hidden, logits [E, A],
  value [E])`. The hidden state is zeroed where an episode starts, so a
  stored hidden state can be fed back as-is when re-running a sequence.
  """
  num_actions: int
  hidden_size: int
  cell: str

  def initial_hidden(self, num_streams: int) -> PyTree:
    zeros = jnp.zeros((num_streams, self.hidden_size), jnp.float32)
    return zeros if self.cell == "gru" else (zeros, zeros)  # LSTM: (c, h)

  @nn.compact
  def __call__(self, hidden, obs, episode_start):
    hidden = jax.tree.map(
        lambda h: jnp.where(episode_start[:, None], jnp.zeros_like(h), h), hidden)
    features = nn.tanh(nn.Dense(self.hidden_size)(obs))
    cell = (nn.GRUCell(self.hidden_size) if self.cell == "gru"
            else nn.OptimizedLSTMCell(self.hidden_size))
    hidden, features = cell(hidden, features)
    actor = nn.tanh(nn.Dense(self.hidden_size)(features))
    logits = nn.Dense(self.num_actions,
                      kernel_init=nn.initializers.orthogonal(0.01))(actor)
    critic = nn.tanh(nn.Dense(self.hidden_size)(features))
    value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic)
    return hidden, logits, value[..., 0]


@flax.struct.dataclass
class RunnerState:
  """Everything one seed's training carries from one update to the next."""
  params: PyTree
  opt_state: PyTree
  rollout_state: jaxbuf.RolloutState
  env_state: PyTree           # gymnax state, each leaf [N, ...]
  obs: jax.Array              # [N, *obs_shape], float32
  hidden: PyTree              # recurrent state [N, H] (LSTM: a pair); () if none
  episode_start: jax.Array    # [N], bool: obs is the first of an episode
  episode_returns: jax.Array  # [N], float32: return so far of each running episode
  key: jax.Array              # shape=(), a typed PRNG key


class Metrics(NamedTuple):
  """Per-update statistics; sums so the host can average over any window."""
  returns_sum: jax.Array      # (), float32: summed returns of episodes ended
  episodes_ended: jax.Array   # (), float32
  loss: jax.Array             # (), float32: mean total loss over minibatches


class Trainer(NamedTuple):
  """Pure functions of one seed's training; vmap them over seeds."""
  init: Callable[[jax.Array], RunnerState]
  step: Callable[[RunnerState], tuple[RunnerState, Metrics]]


def ppo_loss(logits: jax.Array, values: jax.Array, minibatch: dict[str, Any],
             config: Config) -> jax.Array:
  """The clipped PPO objective over any batch shape `[...]`; logits `[..., A]`."""
  log_probs = jax.nn.log_softmax(logits)
  action_log_probs = jnp.take_along_axis(
      log_probs, minibatch["action"][..., None], axis=-1)[..., 0]
  advantages = jaxbuf.normalize_advantages(minibatch["advantage"])
  ratio = jnp.exp(action_log_probs - minibatch["log_prob"])
  clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
  policy_loss = -jnp.mean(jnp.minimum(ratio * advantages,
                                      clipped_ratio * advantages))
  clipped_values = minibatch["value"] + jnp.clip(
      values - minibatch["value"], -config.clip_eps, config.clip_eps)
  value_loss = 0.5 * jnp.mean(jnp.maximum(
      (values - minibatch["return"]) ** 2,
      (clipped_values - minibatch["return"]) ** 2))
  entropy = -jnp.mean(jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
  return (policy_loss + config.value_coef * value_loss
          - config.entropy_coef * entropy)


def make_trainer(config: Config) -> Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`.

  One `step` is one PPO update: T * N env steps, GAE, then
  `update_epochs * num_minibatches` gradient steps.
  """
  env, env_params = gymnax.make(config.env_name)
  if config.time_limit:
    env_params = env_params.replace(max_steps_in_episode=config.time_limit)
  num_actions = env.action_space(env_params).n
  num_updates = config.total_steps // (config.num_steps * config.num_envs)
  recurrent = config.recurrent != "none"
  if config.recurrent not in ("none", "gru", "lstm"):
    raise ValueError(f"--recurrent must be none, gru or lstm, given "
                     f"{config.recurrent!r}.")
  if recurrent:
    network = RecurrentActorCritic(num_actions, config.hidden_size,
                                   config.recurrent)

    def policy(params, hidden, obs, episode_start):
      return network.apply(params, hidden, obs, episode_start)
  else:
    network = ActorCritic(num_actions, config.hidden_size)

    def policy(params, hidden, obs, episode_start):
      del episode_start
      return (hidden, *network.apply(params, obs))

  learning_rate = optax.linear_schedule(
      config.learning_rate, 0.0,
      transition_steps=max(num_updates, 1) * config.update_epochs
      * config.num_minibatches)
  optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                          optax.adam(learning_rate, eps=1e-5))
  rollout = jaxbuf.rollout_buffer(config.num_steps, config.num_envs)
  vmapped_reset = jax.vmap(env.reset, in_axes=(0, None))
  vmapped_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = vmapped_reset(
        jax.random.split(reset_key, config.num_envs), env_params)
    episode_start = jnp.ones((config.num_envs,), bool)
    if recurrent:
      hidden = network.initial_hidden(config.num_envs)
      params = network.init(network_key, hidden, obs, episode_start)
    else:
      hidden = ()
      params = network.init(network_key, obs)
    example_step = dict(
        obs=obs[0], action=jnp.int32(0), log_prob=jnp.float32(0),
        value=jnp.float32(0), reward=jnp.float32(0),
        terminated=jnp.bool_(False), truncated=jnp.bool_(False),
        truncated_value=jnp.float32(0), episode_start=jnp.bool_(False),
        hidden=jax.tree.map(lambda h: h[0], hidden))
    return RunnerState(
        params=params, opt_state=optimizer.init(params),
        rollout_state=rollout.init(example_step), env_state=env_state,
        obs=obs, hidden=hidden, episode_start=episode_start,
        episode_returns=jnp.zeros((config.num_envs,), jnp.float32), key=key)

  def env_step(state: RunnerState, _) -> tuple[RunnerState, Metrics]:
    key, action_key, env_key = jax.random.split(state.key, 3)
    next_hidden, logits, value = policy(state.params, state.hidden, state.obs,
                                        state.episode_start)
    action = jax.random.categorical(action_key, logits).astype(jnp.int32)
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits),
                                   action[:, None], axis=-1)[:, 0]
    next_obs, env_state, reward, terminated, truncated, info = vmapped_step(
        jax.random.split(env_key, config.num_envs), state.env_state, action,
        env_params)
    # V(final observation) for steps cut by the time limit: the observation
    # the auto-reset replaced, seen with the hidden state this step produced.
    _, _, truncated_value = policy(state.params, next_hidden,
                                   info["final_observation"],
                                   jnp.zeros_like(state.episode_start))
    reward = reward.astype(jnp.float32)
    rollout_state = rollout.add(state.rollout_state, dict(
        obs=state.obs, action=action, log_prob=log_prob, value=value,
        reward=reward, terminated=terminated, truncated=truncated,
        truncated_value=truncated_value, episode_start=state.episode_start,
        hidden=state.hidden))
    episode_returns = state.episode_returns + reward
    episode_ended = terminated | truncated
    state = state.replace(
        rollout_state=rollout_state, env_state=env_state, obs=next_obs,
        hidden=next_hidden, episode_start=episode_ended,
        episode_returns=jnp.where(episode_ended, 0.0, episode_returns), key=key)
    return state, Metrics(
        returns_sum=jnp.sum(jnp.where(episode_ended, episode_returns, 0.0)),
        episodes_ended=jnp.sum(episode_ended.astype(jnp.float32)),
        loss=jnp.zeros((), jnp.float32))

  def minibatch_loss(params, minibatch) -> jax.Array:
    if not recurrent:
      logits, values = network.apply(params, minibatch["obs"])
      return ppo_loss(logits, values, minibatch, config)
    sequences, initial_hidden = minibatch  # [L, E, ...], [E, H]

    def unroll(hidden, inputs):
      obs, episode_start = inputs
      hidden, logits, value = network.apply(params, hidden, obs, episode_start)
      return hidden, (logits, value)
    _, (logits, values) = jax.lax.scan(
        unroll, initial_hidden, (sequences["obs"], sequences["episode_start"]))
    return ppo_loss(logits, values, sequences, config)

  def gradient_step(carry, minibatch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(minibatch_loss)(params, minibatch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def step(state: RunnerState) -> tuple[RunnerState, Metrics]:
    state = state.replace(rollout_state=rollout.reset(state.rollout_state))
    state, step_metrics = jax.lax.scan(env_step, state, None,
                                       length=config.num_steps)
    data = state.rollout_state.data                      # leaves [T, N, ...]
    _, _, last_value = policy(state.params, state.hidden, state.obs,
                              state.episode_start)
    advantages, returns = jaxbuf.compute_gae(
        data["reward"], data["value"], data["terminated"], last_value,
        gamma=config.gamma, gae_lambda=config.gae_lambda,
        truncated=data["truncated"], truncated_values=data["truncated_value"])
    batch = dict(obs=data["obs"], action=data["action"],
                 log_prob=data["log_prob"], value=data["value"],
                 episode_start=data["episode_start"], advantage=advantages,
                 **{"return": returns})

    def epoch(params_and_opt_state, key):
      if recurrent:
        chunks = jaxbuf.sequence_chunks(
            key, batch, data["hidden"], chunk_length=config.sequence_length,
            num_minibatches=config.num_minibatches)
        minibatches = (chunks.data, chunks.initial_hidden)
      else:
        minibatches = jaxbuf.shuffled_minibatches(
            key, batch, num_minibatches=config.num_minibatches)
      return jax.lax.scan(gradient_step, params_and_opt_state, minibatches)

    key, epochs_key = jax.random.split(state.key)
    (params, opt_state), losses = jax.lax.scan(
        epoch, (state.params, state.opt_state),
        jax.random.split(epochs_key, config.update_epochs))
    state = state.replace(params=params, opt_state=opt_state, key=key)
    return state, Metrics(returns_sum=step_metrics.returns_sum.sum(),
                          episodes_ended=step_metrics.episodes_ended.sum(),
                          loss=losses.mean())

  return Trainer(init=init, step=step)


def make_chunk_runner(step: Callable, iterations_per_chunk: int) -> Callable:
  """`states [K, ...] -> (states, metrics [K, iterations_per_chunk])`, jitted.

  The states are donated, so the rollout storage is reused in place from one
  chunk to the next rather than copied.
  """
  def run_chunk(state):
    return jax.lax.scan(lambda carry, _: step(carry), state, None,
                        length=iterations_per_chunk)
  return jax.jit(jax.vmap(run_chunk), donate_argnums=0)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; returns metrics and timings.

  Returns:
    A dict: "returns_sum" and "episodes_ended" float `[K, U]` per update,
    "env_steps_per_iteration" (T * N), "steps_per_second" (env steps of all
    seeds together per second of the training loop, compilation excluded),
    "env_steps_per_seed" (total_steps rounded down to whole chunks),
    "compile_seconds", "final_mean_return" (mean episodic return over the last
    10% of updates, averaged over seeds) and "final_returns" `[K]`.
  """
  trainer = make_trainer(config)
  steps_per_update = config.num_steps * config.num_envs
  num_updates = config.total_steps // steps_per_update
  num_chunks = max(min(config.num_chunks, num_updates), 1)
  updates_per_chunk = max(num_updates // num_chunks, 1)
  run_chunk = make_chunk_runner(trainer.step, updates_per_chunk)

  seeds = jax.random.split(jax.random.key(config.seed), config.num_seeds)
  state = jax.jit(jax.vmap(trainer.init))(seeds)
  compile_start = time.perf_counter()
  compiled = run_chunk.lower(state).compile()
  compile_seconds = time.perf_counter() - compile_start

  chunks = []
  env_steps_per_chunk = updates_per_chunk * steps_per_update
  description = ("PPO" if config.recurrent == "none"
                 else f"PPO-{config.recurrent.upper()}")
  total_env_steps = num_chunks * env_steps_per_chunk * config.num_seeds
  # Counts the env steps of all seeds, like the steps per second printed.
  progress = tqdm.tqdm(total=total_env_steps,
                       unit=" env steps", unit_scale=True,
                       disable=not show_progress,
                       desc=f"{description}, {config.num_seeds} seed(s)")
  loop_start = time.perf_counter()
  for _ in range(num_chunks):
    state, metrics = compiled(state)
    metrics = jax.device_get(metrics)
    chunks.append(metrics)
    recent = metrics.returns_sum.sum() / max(metrics.episodes_ended.sum(), 1)
    progress.set_postfix(mean_return=f"{recent:.1f}")
    progress.update(env_steps_per_chunk * config.num_seeds)
  loop_seconds = time.perf_counter() - loop_start
  progress.close()

  returns_sum = np.concatenate([c.returns_sum for c in chunks], axis=1)
  episodes_ended = np.concatenate([c.episodes_ended for c in chunks], axis=1)
  final_returns = tail_mean_return(returns_sum, episodes_ended)
  return dict(returns_sum=returns_sum, episodes_ended=episodes_ended,
              env_steps_per_iteration=steps_per_update,
              env_steps_per_seed=total_env_steps // config.num_seeds,
              steps_per_second=total_env_steps / loop_seconds,
              compile_seconds=compile_seconds,
              final_returns=final_returns,
              final_mean_return=float(final_returns.mean()))


def tail_mean_return(returns_sum: np.ndarray, episodes_ended: np.ndarray,
                     fraction: float = 0.1) -> np.ndarray:
  """Mean episodic return per seed over the last `fraction` of updates `[K]`."""
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


def plot_learning_curve(result: dict[str, Any], path: str, title: str) -> None:
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
    axes.plot(env_steps, curve, color="tab:orange", alpha=0.3, linewidth=1)
  axes.plot(env_steps, mean_curve, color="tab:orange",
            label=f"mean of {len(curves)} seeds")
  axes.set(xlabel="env steps per seed", ylabel="episodic return", title=title)
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def parse_config(argv: list[str] | None = None) -> tuple[Config, str | None]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for field in dataclasses.fields(Config):
    parser.add_argument("--" + field.name.replace("_", "-"), type=field.type,
                        default=field.default)
  parser.add_argument("--plot", default=None,
                      help="save the learning curve to this image file")
  args = vars(parser.parse_args(argv))
  plot = args.pop("plot")
  return Config(**args), plot


def main(argv: list[str] | None = None) -> None:
  config, plot = parse_config(argv)
  result = train(config)
  print(f"env steps per second: {result['steps_per_second']:,.0f} "
        f"({config.num_seeds} seed(s) x {config.num_envs} envs, "
        f"{result['env_steps_per_seed']:,} steps per seed; "
        f"compilation {result['compile_seconds']:.1f} s, not counted)")
  print("final return per seed: "
        + " ".join(f"{r:.1f}" for r in result["final_returns"]))
  if plot:
    plot_learning_curve(result, plot, f"PPO, {config.env_name}")
  print(f"final mean return: {result['final_mean_return']:.1f}")


if __name__ == "__main__":
  main()
