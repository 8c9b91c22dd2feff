"""n-step DQN on sequence replay: observations stored once, one jitted program.

Shape key: K seeds, N envs, S sample size, L = n + 1 window length, A actions.

The replay buffer holds each env's stream of steps (`jaxbuf.sequence_replay`)
instead of `(obs, action, reward, next_obs)` items, so every observation is
stored once; a sampled window of n + 1 steps gives the n-step transition of
its first step (`jaxbuf.n_step_transitions`), `next_obs` read from the window.

Truncation: when an episode ends, the stream gets one extra step holding
gymnax's `info["final_observation"]`, flagged `last` (its action and reward
are padding). A transition stops at a `last` step and bootstraps from it,
the true final observation; SB3's `optimize_memory_usage` bootstraps from the
reset observation there instead (SB3 #934). A termination stops it with
discount 0. Each collect step is one add: the step of every env, and as
`final_steps` the final observations, written by the envs whose final step
is flagged `last` (the buffer reads episode ends from that flag).

  python examples/nstep_dqn.py                        # n = 3, one seed
  python examples/nstep_dqn.py --num-seeds 4 --plot nstep_dqn.png
  python examples/nstep_dqn.py --replay prioritized   # prioritized windows

The loop (learning gated by `jaxbuf.cond_update`, target copies, K seeds
vmapped) is examples/q_learning.py's, as for examples/dqn.py; only the replay
and the TD target differ.
"""

import dataclasses
import functools
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

import jaxbuf

from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig, training.GymnaxConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py and examples/q_learning.py)."""

  n_step: int = 3
  buffer_size: int = 10_000  # stream steps over all envs
  # Half of examples/dqn.py's: n-step targets move further per update. With
  # 2.5e-4, 4 seeds reached 500 by mid-training, then two fell back (final
  # mean 362.4); with 1.25e-4 the final mean was 496.5.
  learning_rate: float = 1.25e-4


class Step(NamedTuple):
  """One stream step; at a `last` step only `obs` is meaningful."""

  obs: jax.Array  # [*obs_shape], float32
  action: jax.Array  # (), int32: taken at obs
  reward: jax.Array  # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action truly ended the episode
  last: jax.Array  # (), bool: obs is an episode's final observation


def bytes_per_step(example: PyTree) -> int:
  return sum(
    np.dtype(leaf.dtype).itemsize * int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(example)
  )


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> state` and `step(state) -> (state, metrics)`."""
  envs = training.make_vector_env(config.env_name, config.time_limit, config.num_envs)
  network = q_learning.QNetwork(envs.num_actions, config.hidden_size)
  stream = (config.num_envs, config.buffer_size, config.n_step + 1)
  buffer = q_learning.replay_buffer(
    config,
    functools.partial(jaxbuf.sequence_replay, *stream),
    functools.partial(jaxbuf.prioritized_sequence_replay, *stream),
  )
  optimizer = q_learning.make_optimizer(config)

  def init(key: jax.Array) -> q_learning.EnvLearnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    example = Step(
      obs=obs[0],
      action=jnp.int32(0),
      reward=jnp.float32(0),
      terminated=jnp.bool_(False),
      last=jnp.bool_(False),
    )
    return q_learning.EnvLearnerState.start(
      key,
      network.init(network_key, obs[0]),
      optimizer,
      buffer.init(example),
      env_state=env_state,
      obs=obs,
      episode_returns=jnp.zeros(config.num_envs, jnp.float32),
    )

  def td_loss(params, target_params, sample: jaxbuf.SequenceSample):
    window = sample.items  # leaves [S, n + 1, ...]
    batch = jaxbuf.n_step_transitions(
      window.obs,
      window.action,
      window.reward,
      window.terminated,
      window.last,
      n=config.n_step,
      gamma=config.gamma,
    )
    q_taken = q_learning.q_of(network.apply(params, batch.obs), batch.action)
    next_q = q_learning.double_q(
      network.apply(params, batch.next_obs), network.apply(target_params, batch.next_obs)
    )
    target = jax.lax.stop_gradient(batch.reward + batch.discount * next_q)
    # Windows starting at a final-observation step hold no transition.
    td_error = jnp.where(batch.valid, q_taken - target, 0.0)
    loss = jnp.sum(sample.weights * 0.5 * td_error**2) / jnp.maximum(jnp.sum(batch.valid), 1)
    return loss, td_error

  def collect(state, actions, env_key):
    step = envs.step(env_key, state.env_state, actions)
    no = jnp.zeros(config.num_envs, bool)
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(
      state.buffer_state,
      Step(obs=state.obs, action=actions, reward=step.reward, terminated=step.terminated, last=no),
      final_steps=Step(
        obs=step.final_obs,
        action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(step.reward),
        terminated=no,
        last=step.ended,
      ),
    )
    return state.stepped(buffer_state, step)

  return q_learning.make_trainer(
    config,
    buffer=buffer,
    optimizer=optimizer,
    td_loss=td_loss,
    init=init,
    q_values=lambda params, state: network.apply(params, state.obs),
    collect=collect,
    title=(f"{config.n_step}-step DQN ({config.replay} sequence replay), {config.env_name}"),
  )


def memory_per_transition(
  episodes_per_step: float, obs_shape: tuple[int, ...] = (4,), obs_dtype: Any = jnp.float32
) -> dict[str, float]:
  """Storage bytes per transition held: the stream vs one-step items.

  The stream holds 1 + `episodes_per_step` steps per transition (each
  episode adds its final-observation step); the item buffer one
  `(obs, action, reward, next_obs, terminated)` with `next_obs`.
  """
  obs = jax.ShapeDtypeStruct(obs_shape, obs_dtype)
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
  stream = bytes_per_step(
    Step(obs, scalar(jnp.int32), scalar(jnp.float32), scalar(jnp.bool_), scalar(jnp.bool_))
  )
  # The buffer's own per-step episode flag (one bool) counts too.
  stream = (stream + 1) * (1.0 + episodes_per_step)
  items = bytes_per_step((obs, scalar(jnp.int32), scalar(jnp.float32), obs, scalar(jnp.bool_)))
  return dict(stream=stream, items=float(items), ratio=stream / items)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict and
  "memory", `memory_per_transition` at the episode rate seen."""
  result = training.train(make_trainer(config), config, show_progress)
  episodes_per_step = result["episodes_ended"].sum() / (
    result["env_steps_per_seed"] * config.num_seeds
  )
  result["memory"] = memory_per_transition(float(episodes_per_step))
  return result


def report(config: Config, result: dict[str, Any]) -> None:
  del config
  memory = result["memory"]
  print(
    f"bytes per transition held: stream {memory['stream']:.1f} "
    f"(final-observation steps included), items with next_obs "
    f"{memory['items']:.0f}: {memory['ratio']:.2f}x"
  )


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0], report)


if __name__ == "__main__":
  main()
