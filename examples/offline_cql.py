"""Offline CQL on CartPole from a Minari dataset, against behaviour cloning.

Shape key: K seeds, S sample size, A actions, E evaluation episodes.

1. Record: a scripted CartPole policy (push towards where the pole is
   falling) runs in gymnasium under Minari's `DataCollector`, which writes
   the dataset to disk (MINARI_DATASETS_PATH). The behaviour is a poor one:
   a random action with probability `epsilon`, else the scripted action's
   opposite with probability `wrong`, else the scripted action. The data
   then holds good actions, but fewer of them than bad ones: behaviour
   cloning copies the majority and fails, while CQL's values pick the
   actions that keep the pole up.
2. Load: `jaxbuf.from_minari` streams the episodes into a uniform replay
   buffer of `jaxbuf.Transition`s (terminations and truncations apart, each
   truncated episode's true final observation as its last `next_obs`).
3. Train offline: discrete CQL (Kumar et al. 2020): Double DQN's TD loss plus
   `cql_alpha * (logsumexp_a Q(s, a) - Q(s, a_data))`, which pushes down the
   values of actions the data does not take. All updates of K seeds run in
   one jitted `lax.scan`, vmapped over seeds, sampling from the one loaded
   buffer state. Behaviour cloning (cross-entropy on the data's actions)
   trains the same way on the same buffer, as the baseline.
4. Evaluate online: the greedy policies run in gymnax's CartPole-v1 (the
   same dynamics, jitted) for E episodes each.

The bar, printed at the end: on every seed, CQL's return beats both the
dataset's own mean return and behaviour cloning's mean return by `margin`.
Measured (2 seeds, the defaults): dataset mean 19.2, BC 8.6 8.9, CQL 260.9
194.4.

  python examples/offline_cql.py                 # the bar: 2 seeds
  python examples/offline_cql.py --wrong 0 --epsilon 0.5   # a good behaviour:
                                                 # BC and CQL both reach 500
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
import gymnasium
import jax
import jax.numpy as jnp
import minari
import numpy as np
import optax

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import training  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""

  dataset_steps: int = 50_000  # env steps recorded
  epsilon: float = 0.2  # behaviour: random action probability
  wrong: float = 0.55  # behaviour: else the scripted action's
  # opposite, with this probability
  time_limit: int = 500  # CartPole-v1's own
  num_seeds: int = 2  # K: CQL and BC seeds, vmapped
  seed: int = 0
  num_updates: int = 20_000
  batch_size: int = 256
  learning_rate: float = 3e-4
  gamma: float = 0.99
  cql_alpha: float = 1.0
  target_update_interval: int = 500
  hidden_size: int = 128
  eval_episodes: int = 10  # E per seed
  margin: float = 100.0  # the bar: CQL - dataset mean return


class QNetwork(nn.Module):
  """An MLP from observations `[..., D]` to one value per action `[..., A]`
  (Q-values for CQL, logits for behaviour cloning)."""

  num_actions: int
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> jax.Array:
    x = nn.relu(nn.Dense(self.hidden_size)(obs))
    x = nn.relu(nn.Dense(self.hidden_size)(x))
    return nn.Dense(self.num_actions)(x)


def scripted_action(obs: np.ndarray) -> int:
  """Push the cart towards the side the pole falls to (angle, angular
  velocity): a good but not perfect policy."""
  return int(obs[2] + 0.5 * obs[3] > 0)


def record(dataset_id: str, config: Config) -> minari.MinariDataset:
  """Runs the epsilon-noisy scripted policy under Minari's DataCollector."""
  env = minari.DataCollector(gymnasium.make("CartPole-v1", max_episode_steps=config.time_limit))
  rng = np.random.default_rng(config.seed)
  obs, _ = env.reset(seed=config.seed)
  for _ in range(config.dataset_steps):
    draw = rng.random()
    if draw < config.epsilon:
      action = int(rng.integers(2))
    else:
      wrong = draw < config.epsilon + (1 - config.epsilon) * config.wrong
      action = scripted_action(obs) ^ int(wrong)
    obs, _, terminated, truncated, _ = env.step(action)
    if terminated or truncated:
      obs, _ = env.reset()
  dataset = env.create_dataset(
    dataset_id,
    algorithm_name=f"scripted, epsilon {config.epsilon}",
    author="jaxbuf examples",
    author_email="-",
    code_permalink="-",
    description="CartPole-v1, scripted policy with epsilon-random actions",
  )
  env.close()
  return dataset


def dataset_mean_return(dataset: minari.MinariDataset) -> float:
  return float(np.mean([episode.rewards.sum() for episode in dataset.iterate_episodes()]))


def cql_loss(params, target_params, batch, network, config, cql_alpha):
  """Double DQN TD loss + CQL's conservative penalty (alpha 0: plain DQN)."""
  q = network.apply(params, batch.obs)
  q_taken = jnp.take_along_axis(q, batch.action[:, None], axis=1)[:, 0]
  next_action = jnp.argmax(network.apply(params, batch.next_obs), axis=1)
  next_q = jnp.take_along_axis(
    network.apply(target_params, batch.next_obs), next_action[:, None], axis=1
  )[:, 0]
  # A truncated episode bootstraps from its true final observation; only a
  # termination stops the bootstrap.
  target = batch.reward + config.gamma * (1.0 - batch.terminated) * next_q
  td = jnp.mean(optax.huber_loss(q_taken, jax.lax.stop_gradient(target)))
  conservative = jnp.mean(jax.nn.logsumexp(q, axis=1) - q_taken)
  return td + cql_alpha * conservative


def bc_loss(params, target_params, batch, network, config, cql_alpha):
  del target_params, config, cql_alpha
  logits = network.apply(params, batch.obs)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch.action))


def make_train(buffer: jaxbuf.Buffer, network: nn.Module, config: Config, loss_fn) -> Any:
  """`train(buffer_state, key) -> params`: every update in one `lax.scan`."""
  optimizer = optax.adam(config.learning_rate)

  def train(buffer_state, key):
    init_key, key = jax.random.split(key)
    example = jax.tree.map(lambda x: x[0], buffer_state.storage.obs)
    params = network.init(init_key, example)

    def update(carry, step):
      params, target_params, opt_state, key = carry
      key, sample_key = jax.random.split(key)
      batch = buffer.sample(buffer_state, sample_key, config.batch_size).items
      batch = batch._replace(
        reward=batch.reward.astype(jnp.float32),
        terminated=batch.terminated.astype(jnp.float32),
        action=batch.action.astype(jnp.int32),
      )
      loss, grads = jax.value_and_grad(loss_fn)(
        params, target_params, batch, network, config, config.cql_alpha
      )
      updates, opt_state = optimizer.update(grads, opt_state)
      params = optax.apply_updates(params, updates)
      target_params = optax.periodic_update(
        params, target_params, step, config.target_update_interval
      )
      return (params, target_params, opt_state, key), loss

    carry = (params, params, optimizer.init(params), key)
    (params, _, _, _), losses = jax.lax.scan(update, carry, jnp.arange(config.num_updates))
    return params, losses[-100:].mean()

  return train


def make_evaluate(network: nn.Module, config: Config) -> Any:
  """`evaluate(params, key) -> mean return` of E greedy episodes in gymnax."""
  envs = training.make_vector_env("CartPole-v1", config.time_limit, config.eval_episodes)

  def evaluate(params, key):
    reset_key, key = jax.random.split(key)
    obs, env_state = envs.reset(reset_key)

    def step(carry, step_key):
      obs, env_state, returns, running = carry
      action = jnp.argmax(network.apply(params, obs), axis=-1)
      outcome = envs.step(step_key, env_state, action)
      returns = returns + jnp.where(running, outcome.reward, 0.0)
      running = running & ~outcome.ended
      return (outcome.obs, outcome.env_state, returns, running), None

    carry = (obs, env_state, jnp.zeros(config.eval_episodes), jnp.ones(config.eval_episodes, bool))
    (_, _, returns, _), _ = jax.lax.scan(step, carry, jax.random.split(key, config.time_limit))
    return returns.mean()

  return evaluate


def run(config: Config, datasets_path: str | None = None) -> dict[str, Any]:
  """Records, loads, trains CQL and BC on K seeds, evaluates; the results."""
  if datasets_path is not None:
    os.environ["MINARI_DATASETS_PATH"] = datasets_path
  dataset_id = (
    f"cartpole/scripted-eps{int(config.epsilon * 100)}-"
    f"wrong{int(config.wrong * 100)}-seed{config.seed}-"
    f"steps{config.dataset_steps}-v0"
  )
  with warnings.catch_warnings():
    # Minari warns that this dataset has no eval_env or versioned code.
    warnings.simplefilter("ignore", UserWarning)
    try:
      dataset = minari.load_dataset(dataset_id)
    except FileNotFoundError:
      dataset = record(dataset_id, config)
  buffer = jaxbuf.uniform_replay(dataset.total_steps)
  start = time.perf_counter()
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  state = jaxbuf.from_minari(dataset, buffer, state)
  load_seconds = time.perf_counter() - start

  network = QNetwork(2, config.hidden_size)
  evaluate = jax.vmap(make_evaluate(network, config))
  keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)
  results = {
    "dataset_mean_return": dataset_mean_return(dataset),
    "dataset_episodes": dataset.total_episodes,
    "dataset_steps": dataset.total_steps,
    "load_seconds": load_seconds,
  }
  for name, loss_fn in (("cql", cql_loss), ("bc", bc_loss)):
    train = jax.jit(jax.vmap(make_train(buffer, network, config, loss_fn), in_axes=(None, 0)))
    start = time.perf_counter()
    params, _ = jax.block_until_ready(train(state, keys))
    results[f"{name}_seconds"] = time.perf_counter() - start
    eval_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    results[f"{name}_returns"] = np.asarray(evaluate(params, eval_keys))
  baseline = max(results["dataset_mean_return"], float(np.mean(results["bc_returns"])))
  results["bar_met"] = bool(np.all(results["cql_returns"] > baseline + config.margin))
  return results


def plot_returns(results: dict[str, Any], path: str) -> None:
  """Saves each seed's evaluation return of CQL and BC (dots) against the
  dataset's mean return (a line), to `path`: offline training has no
  learning curve in env steps."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  figure = Figure(figsize=(5, 3.5))
  axes = figure.subplots()
  for position, (name, color) in enumerate((("cql", "tab:red"), ("bc", "tab:gray"))):
    returns = results[f"{name}_returns"]
    axes.scatter(
      np.full(len(returns), position), returns, color=color, label=f"{name.upper()}, one dot a seed"
    )
  axes.axhline(
    results["dataset_mean_return"], color="black", linestyle="--", label="dataset mean return"
  )
  axes.set(
    xticks=[0, 1],
    xticklabels=["CQL", "BC"],
    xlim=(-0.5, 1.5),
    ylabel="evaluation return",
    title=f"Offline CartPole from {results['dataset_episodes']} episodes",
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
    f"{results['dataset_steps']} steps, loaded in "
    f"{results['load_seconds']:.2f} s; mean return "
    f"{results['dataset_mean_return']:.1f}"
  )
  for name in ("cql", "bc"):
    print(
      f"{name.upper():>3} return per seed: "
      + " ".join(f"{r:.1f}" for r in results[f"{name}_returns"])
      + f"  ({results[f'{name}_seconds']:.1f} s, compilation included)"
    )
  print(
    f"bar (CQL > max(dataset mean, BC mean) + {config.margin:g} on every "
    f"seed): "
    f"{'met' if results['bar_met'] else 'NOT met'}"
  )
  if plot:
    plot_returns(results, plot)
  return results


if __name__ == "__main__":
  main()
