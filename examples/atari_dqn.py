"""DQN on an Atari game (ALE), 84x84 frames stacked by the replay buffer.

Shape key: N envs, S sample size, A actions.

ALE's vector env (`ale_py.vector_env.AtariVectorEnv`, C++ threads) runs on
the host and returns single 84x84 grayscale frames (`stack_num=1`): the
stacks of 4 the network sees are built by `jaxbuf.frame_stack_replay` at
sample time from frames stored once (about 7 KB per transition, 7 GB for a
million), and by the actor for the envs it steps. One jitted call per
vector step takes the env's outputs, adds them to the stream, runs one
learner step (sample S, Double DQN loss, Adam) every `--train-every`
vector steps, and returns the next actions: the only host work is ALE's.

The env resets itself on the step after an episode ends (gymnasium's
NextStep autoreset): that step returns the first frame of the next episode,
and its action is ignored, so it adds no transition; the frame an episode
ended on is added once as its final step (`episode_end`), so a time limit
bootstraps from it.

  python examples/atari_dqn.py --total-steps 4000 --buffer-size 100000 \
      --learning-starts 1000                 # a CPU smoke run: speed, memory
  JAX_PLATFORMS=cuda python examples/atari_dqn.py --game breakout \
      --total-steps 10000000                 # on a GPU: the real run
"""

import dataclasses
import pathlib
import resource
import sys
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402

NUM_STACK = 4


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""

  game: str = "pong"
  total_steps: int = 10_000_000  # env steps, all envs together
  seed: int = 0
  num_envs: int = 8
  buffer_size: int = 1_000_000  # frames over all envs
  batch_size: int = 32
  learning_starts: int = 80_000  # env steps before learning
  train_every: int = 1  # vector steps (N env steps) per update
  n_step: int = 3
  learning_rate: float = 6.25e-5
  gamma: float = 0.99
  target_update_interval: int = 8_000  # env steps
  epsilon_end: float = 0.01
  epsilon_fraction: float = 0.1
  report_every: int = 1_000  # vector steps between progress lines


class Step(NamedTuple):
  obs: jax.Array  # [84, 84] uint8: one frame
  action: jax.Array  # () int32
  reward: jax.Array  # () float32, clipped to [-1, 1] by the env
  terminated: jax.Array  # () bool


class EnvOutput(NamedTuple):
  """What one `AtariVectorEnv.step` returned, leaves `[N, ...]`."""

  frame: jax.Array  # [N, 84, 84] uint8
  reward: jax.Array  # [N] float32
  terminated: jax.Array  # [N] bool
  truncated: jax.Array  # [N] bool


class NatureCNN(nn.Module):
  """Mnih et al. (2015): stacks `[..., 84, 84, 4]` uint8 -> Q `[..., A]`."""

  num_actions: int

  @nn.compact
  def __call__(self, stacks: jax.Array) -> jax.Array:
    x = stacks.astype(jnp.float32) / 255.0
    x = nn.relu(nn.Conv(32, (8, 8), (4, 4))(x))
    x = nn.relu(nn.Conv(64, (4, 4), (2, 2))(x))
    x = nn.relu(nn.Conv(64, (3, 3), (1, 1))(x))
    x = nn.relu(nn.Dense(512)(x.reshape(x.shape[:-3] + (-1,))))
    return nn.Dense(self.num_actions)(x)


class RunnerState(q_learning.LearnerState):
  stacks: jax.Array  # [N, 84, 84, 4] uint8: the actor's stacks
  actions: jax.Array  # [N] int32: the actions the env is stepping
  resetting: jax.Array  # [N] bool: the env's next output is a reset frame


def make_step(config: Config, num_actions: int):
  """`init(key, first_frames) -> state`, `step(state, output) -> (state, loss)`."""
  network = NatureCNN(num_actions)
  buffer = jaxbuf.frame_stack_replay(
    config.num_envs,
    config.buffer_size,
    NUM_STACK,
    n_step=config.n_step,
    gamma=config.gamma,
    pad="first",
  )
  optimizer = optax.adam(config.learning_rate, eps=1.5e-4)
  vector_steps = config.total_steps // config.num_envs
  epsilon = optax.linear_schedule(
    1.0, config.epsilon_end, int(config.epsilon_fraction * vector_steps)
  )
  learning_starts = config.learning_starts // config.num_envs
  target_period = max(config.target_update_interval // config.num_envs, 1)

  def init(key, frames):
    stacks = jnp.repeat(frames[..., None], NUM_STACK, axis=-1)
    params = network.init(key, stacks[:1])
    example = Step(
      obs=frames[0], action=jnp.int32(0), reward=jnp.float32(0), terminated=jnp.bool_(False)
    )
    return RunnerState.start(
      key,
      params,
      optimizer,
      buffer.init(example),
      stacks=stacks,
      actions=jnp.zeros(config.num_envs, jnp.int32),
      resetting=jnp.zeros(config.num_envs, bool),
    )

  def td_loss(params, target_params, sample):
    batch = sample.items
    q_taken = q_learning.q_of(network.apply(params, batch.obs), batch.action)
    next_q = q_learning.double_q(
      network.apply(params, batch.next_obs), network.apply(target_params, batch.next_obs)
    )
    target = jax.lax.stop_gradient(batch.reward + batch.discount * next_q)
    return jnp.mean(optax.huber_loss(q_taken, target)), q_taken - target

  learn = q_learning.td_learner(buffer, optimizer, td_loss, config.batch_size)

  def step(state: RunnerState, output: EnvOutput):
    key, explore_key, action_key, learn_key = jax.random.split(state.key, 4)
    stepped = ~state.resetting  # a reset step holds no transition
    ended = stepped & (output.terminated | output.truncated)
    no = jnp.zeros(config.num_envs, bool)
    buffer_state = buffer.add(
      state.buffer_state,
      Step(
        obs=state.stacks[..., -1],
        action=state.actions,
        reward=output.reward,
        terminated=output.terminated & stepped,
      ),
      mask=stepped,
    )
    buffer_state = buffer.add(
      buffer_state,
      Step(
        obs=output.frame,
        action=jnp.zeros_like(state.actions),
        reward=jnp.zeros_like(output.reward),
        terminated=no,
      ),
      mask=ended,
      episode_end=~no,
    )
    pushed = jnp.concatenate([state.stacks[..., 1:], output.frame[..., None]], axis=-1)
    fresh = jnp.repeat(output.frame[..., None], NUM_STACK, axis=-1)
    stacks = jnp.where(state.resetting[:, None, None, None], fresh, pushed)
    state = state.replace(
      buffer_state=buffer_state,
      stacks=stacks,
      resetting=ended,
      iteration=state.iteration + 1,
      key=key,
    )
    should_learn = (
      buffer.can_sample(buffer_state, config.batch_size)
      & (state.iteration >= learning_starts)
      & (state.iteration % config.train_every == 0)
    )
    state, loss = q_learning.learn_when(
      should_learn, learn, state, learn_key, target_period=target_period
    )
    actions = q_learning.epsilon_greedy(
      explore_key, action_key, network.apply(state.params, stacks), epsilon(state.iteration)
    )
    return state.replace(actions=actions), loss

  return init, jax.jit(step, donate_argnums=0)


def main(argv: list[str] | None = None) -> None:
  config, plot = training.parse_config(Config, __doc__.split("\n")[0], argv)
  # After the flags: `--help` works without the atari extra installed.
  from ale_py.vector_env import AtariVectorEnv  # pylint: disable=import-outside-toplevel

  envs = AtariVectorEnv(config.game, config.num_envs, stack_num=1, autoreset_mode="NextStep")
  frames, _ = envs.reset(seed=config.seed)
  init, step = make_step(config, int(envs.single_action_space.n))
  state = jax.jit(init)(jax.random.key(config.seed), jnp.asarray(frames[:, 0]))
  returns = training.EpisodeReturns(config.num_envs)
  start = time.perf_counter()
  compile_seconds = 0.0
  vector_steps = config.total_steps // config.num_envs
  for iteration in range(vector_steps):
    frames, rewards, terminated, truncated, _ = envs.step(np.asarray(state.actions))
    output = EnvOutput(
      frame=frames[:, 0],
      reward=rewards.astype(np.float32),
      terminated=terminated,
      truncated=truncated,
    )
    before = time.perf_counter()
    state, loss = step(state, output)
    if iteration == 0:
      jax.block_until_ready(state)
      compile_seconds = time.perf_counter() - before
    returns.record(iteration * config.num_envs, rewards, terminated | truncated)
    if (iteration + 1) % config.report_every == 0:
      recent = np.mean([r for _, r in returns.ended[-20:]]) if returns.ended else float("nan")
      print(
        f"{(iteration + 1) * config.num_envs:,} env steps, "
        f"{len(returns.ended)} episodes, recent return {recent:.1f}, "
        f"loss {float(loss):.4f}",
        flush=True,
      )
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start - compile_seconds
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  held = int(np.sum(state.buffer_state.steps_held))
  print(
    f"env steps per second: {vector_steps * config.num_envs / seconds:,.0f}"
    f" ({config.num_envs} envs, {vector_steps * config.num_envs:,} steps,"
    f" first call {compile_seconds:.1f} s not counted)"
  )
  print(f"frames held {held:,} of {config.buffer_size:,}; peak RSS {peak / 2**30:.2f} GiB")
  print(f"episodes finished: {len(returns.ended)}; mean return {returns.mean_since(0):.1f}")
  if plot:
    returns.plot(plot, f"DQN on ALE {config.game}")


if __name__ == "__main__":
  main()
