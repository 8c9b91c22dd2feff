"""PureJaxRL's fused DQN on flashbax's flat buffer against jaxbuf's storage-once route.

One process, the contenders interleaved over the repeats, so a change in
the load of a shared machine hits each alike. Each runs the same
PureJaxRL-style training program (purejaxrl/dqn.py's loop, written here:
gymnax CartPole-v1 with PureJaxRL's LogWrapper, `NUM_ENVS` envs, an MLP
(120, 84), one learner update per `training_interval` env steps behind a
`lax.cond`, seeds vmapped, the whole run one `jax.jit`), and differs only in
the replay calls:

* flashbax: `fbx.make_flat_buffer(...)`, a step `(obs, action, reward,
  done)` per env per add, `sample(...).experience.first / .second`, warm
  once `can_sample(state)`.
* jaxbuf: `jaxbuf.sequence_replay(num_envs, capacity, 2)`, the step without
  `done`, added as `add(state, step, episode_end=done)`, and
  `jaxbuf.step_pairs(buffer.sample(state, key, batch_size))`: each
  observation stored once, as in flashbax (docs/migration/flashbax_flat.md).
* jaxbuf-next-obs (info): `jaxbuf.uniform_replay(capacity)` with each
  transition stored whole (`obs` and `next_obs`), the port that doubles the
  observations' bytes.
* floor (info): no buffer; the loss reads the steps just taken. The time of
  the rest of the program, so `(jaxbuf - floor) / (flashbax - floor)` is the
  buffers' own cost ratio.

Figures: env steps per second of the whole run (compiled ahead; compile
time apart) and the bytes of the buffer state each holds; then bytes per
transition at an 84x84x4 uint8 observation and at a 17-float state
(flashbax's flat buffer, jaxbuf's route, the whole-transition port, and
jaxbuf's frame stacks, which store one 84x84 frame per step), computed
from the states' shapes. Goals: jaxbuf's bytes at or under flashbax's, and
its steps per second at least 1.2x flashbax's.

Usage:
  python benchmarks/peers/bench_purejaxrl_dqn.py           # 1e5 env steps x 3 seeds
  python benchmarks/peers/bench_purejaxrl_dqn.py --quick   # a smoke run
  python benchmarks/peers/bench_purejaxrl_dqn.py --memory  # the bytes table alone
"""

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Callable, NamedTuple

import flashbax as fbx
import gymnax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from gymnax.wrappers.purerl import LogWrapper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness  # noqa: E402

import jaxbuf  # noqa: E402

CONTENDERS = ("flashbax", "jaxbuf", "jaxbuf-next-obs", "floor")


@dataclasses.dataclass(frozen=True)
class Config:
  """purejaxrl/dqn.py's settings, the run shortened for a 2-core CPU."""

  num_envs: int = 10
  buffer_size: int = 10_000
  batch_size: int = 128
  total_steps: int = 100_000  # env steps per seed
  num_seeds: int = 3
  epsilon_start: float = 1.0
  epsilon_finish: float = 0.05
  epsilon_anneal_steps: int = 25_000
  target_update_interval: int = 500
  learning_rate: float = 2.5e-4
  learning_starts: int = 1_000
  training_interval: int = 10
  gamma: float = 0.99


class QNetwork(nn.Module):
  action_dim: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(120)(x))
    x = nn.relu(nn.Dense(84)(x))
    return nn.Dense(self.action_dim)(x)


class Batch(NamedTuple):
  """What the loss reads, from any of the buffers."""

  obs: jax.Array  # [B, 4]
  action: jax.Array  # int [B]
  reward: jax.Array  # [B]
  continues: jax.Array  # [B]: 1 - done
  next_obs: jax.Array  # [B, 4]


class Replay(NamedTuple):
  """One contender's replay calls, as the training loop makes them."""

  init: Callable[[Any], Any]  # example (obs, action, reward, done) -> state
  add: Callable[..., Any]  # (state, obs, action, reward, done, next_obs) -> state
  sample: Callable[[Any, jax.Array], Batch]
  warm: Callable[[Any], jax.Array]  # bool (): may learn (flashbax's can_sample)


def flashbax_replay(config: Config) -> Replay:
  buffer = fbx.make_flat_buffer(
    max_length=config.buffer_size,
    min_length=config.batch_size,
    sample_batch_size=config.batch_size,
    add_sequences=False,
    add_batch_size=config.num_envs,
  )

  def add(state, obs, action, reward, done, next_obs):
    del next_obs  # the next add's obs: paired at sample time
    return buffer.add(state, dict(obs=obs, action=action, reward=reward, done=done))

  def sample(state, key):
    pair = buffer.sample(state, key).experience
    first = pair.first
    return Batch(
      first["obs"], first["action"], first["reward"], 1.0 - first["done"], pair.second["obs"]
    )

  return Replay(
    init=lambda example: buffer.init(example),
    add=add,
    sample=sample,
    warm=buffer.can_sample,
  )


def jaxbuf_replay(config: Config) -> Replay:
  num_envs = config.num_envs
  buffer = jaxbuf.sequence_replay(num_envs, config.buffer_size // num_envs * num_envs, 2)
  # flashbax's can_sample: min_length // add_batch_size + 1 adds made.
  min_steps = (config.batch_size // num_envs + 1) * num_envs

  def init(example):
    return buffer.init({name: example[name] for name in ("obs", "action", "reward")})

  def add(state, obs, action, reward, done, next_obs):
    del next_obs
    return buffer.add(state, dict(obs=obs, action=action, reward=reward), episode_end=done)

  def sample(state, key):
    pair = jaxbuf.step_pairs(buffer.sample(state, key, config.batch_size))
    first = pair.first
    return Batch(
      first["obs"], first["action"], first["reward"], pair.same_episode, pair.second["obs"]
    )

  return Replay(init, add, sample, warm=lambda state: state.steps_held.sum() >= min_steps)


def jaxbuf_next_obs_replay(config: Config) -> Replay:
  buffer = jaxbuf.uniform_replay(config.buffer_size)

  def init(example):
    return buffer.init({**example, "next_obs": example["obs"]})

  def add(state, obs, action, reward, done, next_obs):
    return buffer.add(
      state, dict(obs=obs, action=action, reward=reward, done=done, next_obs=next_obs)
    )

  def sample(state, key):
    items = buffer.sample(state, key, config.batch_size).items
    return Batch(
      items["obs"], items["action"], items["reward"], 1.0 - items["done"], items["next_obs"]
    )

  return Replay(init, add, sample, warm=lambda state: state.size >= config.batch_size)


def floor_replay(config: Config) -> Replay:
  """No buffer: the batch is the steps just taken, tiled (the loss's data
  changes each step, nothing is stored). What the run costs with a buffer
  that costs nothing: the fastest any buffer could make it."""
  repeats = -(-config.batch_size // config.num_envs)

  def tiled(x):
    return jnp.tile(x, (repeats,) + (1,) * (x.ndim - 1))[: config.batch_size]

  def add(state, obs, action, reward, done, next_obs):
    del state
    return Batch(obs, action, reward, 1.0 - done, next_obs)

  def init(example):
    return add(
      None,
      *(
        jnp.zeros((config.num_envs, *jnp.shape(x)), jnp.asarray(x).dtype)
        for x in (
          example["obs"],
          example["action"],
          example["reward"],
          example["done"],
          example["obs"],
        )
      ),
    )

  return Replay(init, add, lambda state, key: jax.tree.map(tiled, state), warm=lambda state: True)


REPLAYS = {
  "floor": floor_replay,
  "flashbax": flashbax_replay,
  "jaxbuf": jaxbuf_replay,
  "jaxbuf-next-obs": jaxbuf_next_obs_replay,
}


def make_train(config: Config, replay: Replay):
  """PureJaxRL's `train(rng)`: the whole run, one program; returns the final
  runner state and the mean return of the episodes that ended."""
  env, env_params = gymnax.make("CartPole-v1")
  env = LogWrapper(env)
  num_envs = config.num_envs
  network = QNetwork(env.action_space(env_params).n)
  tx = optax.adam(config.learning_rate)
  num_updates = config.total_steps // num_envs

  def train(rng):
    rng, reset_key, net_key = jax.random.split(rng, 3)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
      jax.random.split(reset_key, num_envs), env_params
    )
    example = dict(
      obs=jnp.zeros(env.observation_space(env_params).shape, jnp.float32),
      action=jnp.int32(0),
      reward=jnp.float32(0),
      done=jnp.bool_(False),
    )
    buffer_state = replay.init(example)
    params = network.init(net_key, example["obs"])
    runner = (params, params, tx.init(params), buffer_state, env_state, obs, rng, jnp.int32(0))

    def learn(params, target_params, opt_state, batch):
      q_next = network.apply(target_params, batch.next_obs).max(-1)
      target = batch.reward + batch.continues * config.gamma * q_next

      def loss(params):
        q = network.apply(params, batch.obs)
        chosen = jnp.take_along_axis(q, batch.action[:, None], axis=-1)[:, 0]
        return jnp.mean((chosen - target) ** 2)

      grads = jax.grad(loss)(params)
      updates, opt_state = tx.update(grads, opt_state)
      return optax.apply_updates(params, updates), opt_state

    def update_step(runner, _):
      params, target_params, opt_state, buffer_state, env_state, last_obs, rng, steps = runner
      rng, act_key, explore_key, step_key, sample_key = jax.random.split(rng, 5)
      q = network.apply(params, last_obs)
      epsilon = jnp.clip(
        config.epsilon_start
        + (config.epsilon_finish - config.epsilon_start) * steps / config.epsilon_anneal_steps,
        config.epsilon_finish,
      )
      random_actions = jax.random.randint(act_key, (num_envs,), 0, q.shape[-1])
      explore = jax.random.uniform(explore_key, (num_envs,)) < epsilon
      action = jnp.where(explore, random_actions, q.argmax(-1)).astype(jnp.int32)
      obs, env_state, reward, terminated, truncated, info = jax.vmap(
        env.step, in_axes=(0, 0, 0, None)
      )(jax.random.split(step_key, num_envs), env_state, action, env_params)
      done = terminated | truncated
      steps = steps + num_envs
      buffer_state = replay.add(buffer_state, last_obs, action, reward, done, obs)
      learn_now = (
        replay.warm(buffer_state)
        & (steps > config.learning_starts)
        & (steps % config.training_interval == 0)
      )
      params, opt_state = jax.lax.cond(
        learn_now,
        lambda: learn(params, target_params, opt_state, replay.sample(buffer_state, sample_key)),
        lambda: (params, opt_state),
      )
      target_params = jax.lax.cond(
        steps % config.target_update_interval == 0, lambda: params, lambda: target_params
      )
      ended_return = jnp.sum(info["returned_episode_returns"] * done)
      runner = (params, target_params, opt_state, buffer_state, env_state, obs, rng, steps)
      return runner, (ended_return, jnp.sum(done))

    runner, (returns, ends) = jax.lax.scan(update_step, runner, None, num_updates)
    return runner, returns.sum() / jnp.maximum(ends.sum(), 1)

  return train


def state_bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def memory_rows(num_envs: int = 10, capacity: int = 1_000_000) -> list[tuple[str, str, float]]:
  """Bytes per transition of each layout at two observation shapes: what
  one more step of capacity adds to the state's bytes (the state at
  `2 * capacity` less the state at `capacity`, over `capacity`; the
  per-env counters, a few bytes per env, cancel), from the states' shapes
  (`jax.eval_shape`: nothing is allocated)."""

  def layouts(obs, capacity):
    step = dict(obs=obs, action=jnp.int32(0), reward=jnp.float32(0))
    done = dict(done=jnp.bool_(False))
    flat = fbx.make_flat_buffer(capacity, num_envs, 32, add_batch_size=num_envs)
    found = {
      "flashbax flat buffer": jax.eval_shape(flat.init, {**step, **done}),
      "jaxbuf sequence_replay(N, C, 2)": jax.eval_shape(
        jaxbuf.sequence_replay(num_envs, capacity, 2).init, step
      ),
      "jaxbuf uniform_replay, next_obs stored": jax.eval_shape(
        jaxbuf.uniform_replay(capacity).init, {**step, **done, "next_obs": obs}
      ),
    }
    if len(obs.shape) == 3:  # frames: one 84x84 frame stored per step
      frame = jax.ShapeDtypeStruct(obs.shape[:2], obs.dtype)
      frames = jaxbuf.frame_stack_replay(num_envs, capacity, obs.shape[-1])
      found["jaxbuf frame_stack_replay(K=4)"] = jax.eval_shape(
        frames.init, {**step, "obs": frame, "terminated": jnp.bool_(False)}
      )
    return {name: state_bytes(state) for name, state in found.items()}

  rows = []
  for name, obs in (
    ("84x84x4 uint8", jax.ShapeDtypeStruct((84, 84, 4), jnp.uint8)),
    ("17 float32", jax.ShapeDtypeStruct((17,), jnp.float32)),
  ):
    once, twice = layouts(obs, capacity), layouts(obs, 2 * capacity)
    for layout in once:
      rows.append((name, layout, (twice[layout] - once[layout]) / capacity))
  return rows


def print_memory(verdicts: harness.Verdicts) -> None:
  rows = memory_rows()
  print("\nbytes per transition: what one more step of capacity adds to the state (10 envs)")
  flashbax = {obs: value for obs, layout, value in rows if layout.startswith("flashbax")}
  harness.print_table(
    [("observation", -14), ("layout", -40), ("bytes", 10), ("vs flashbax", 12)],
    [
      (obs, layout, f"{value:,.3f}", harness.ratio_text(value / flashbax[obs]))
      for obs, layout, value in rows
    ],
  )
  for obs, layout, value in rows:
    if layout.startswith("jaxbuf sequence_replay"):
      verdicts.judge(
        f"bytes per transition, {obs}, jaxbuf route / flashbax",
        value / flashbax[obs],
        1.0,
        higher_is_better=False,
      )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run (2e4 env steps)")
  parser.add_argument("--memory", action="store_true", help="the bytes table alone")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--total-steps", type=int, default=None)
  parser.add_argument("--num-seeds", type=int, default=None)
  args = parser.parse_args()
  harness.print_machine()
  verdicts = harness.Verdicts()
  print_memory(verdicts)
  if args.memory:
    verdicts.print("verdicts")
    return
  config = Config()
  if args.quick:
    config = dataclasses.replace(config, total_steps=20_000, learning_starts=500)
  if args.total_steps:
    config = dataclasses.replace(config, total_steps=args.total_steps)
  if args.num_seeds:
    config = dataclasses.replace(config, num_seeds=args.num_seeds)
  repeats = 2 if args.quick else args.repeats
  print(f"\n{config}")
  keys = jax.random.split(jax.random.key(0), config.num_seeds)
  runs, held, returns = {}, {}, {}
  for name in CONTENDERS:
    train = jax.vmap(make_train(config, REPLAYS[name](config)))
    with jax.numpy_rank_promotion("allow"):  # flashbax's sample broadcasts ranks
      compiled = jax.jit(train).lower(keys).compile()
    runs[name] = lambda compiled=compiled: compiled(keys)
    runner, mean_return = harness.block(runs[name]())
    held[name] = state_bytes(runner[3]) // config.num_seeds
    returns[name] = float(mean_return.mean())
  seconds = harness.time_interleaved(runs, repeats=repeats, warmup=0, statistic=min)
  env_steps = config.total_steps * config.num_seeds
  print(f"\nfused PureJaxRL DQN, {config.num_seeds} seeds vmapped, {env_steps:,} env steps a run")
  harness.print_table(
    [("contender", -16), ("run s", 9), ("env steps/s", 12), ("buffer bytes", 13), ("return", 8)],
    [
      (
        name,
        f"{seconds[name]:.3f}",
        f"{env_steps / seconds[name]:,.0f}",
        f"{held[name]:,}",
        f"{returns[name]:.1f}",
      )
      for name in CONTENDERS
    ],
  )
  verdicts.judge(
    "steps/s, jaxbuf route / flashbax flat buffer", seconds["flashbax"] / seconds["jaxbuf"], 1.2
  )
  verdicts.judge(
    "buffer bytes, jaxbuf route / flashbax",
    held["jaxbuf"] / held["flashbax"],
    1.0,
    higher_is_better=False,
  )
  verdicts.info(
    f"jaxbuf route holds {held['jaxbuf'] - held['flashbax']:+,} bytes against flashbax "
    f"(per-env counters: 5 int32 per env against flashbax's 2 scalars)"
  )
  verdicts.info(
    f"steps/s, jaxbuf next_obs port / flashbax: "
    f"{harness.ratio_text(seconds['flashbax'] / seconds['jaxbuf-next-obs'])}, bytes "
    f"{harness.ratio_text(held['jaxbuf-next-obs'] / held['flashbax'])}"
  )

  def above(name):
    return seconds[name] - seconds["floor"]

  verdicts.info(
    f"steps/s, no buffer at all (floor) / flashbax: "
    f"{harness.ratio_text(seconds['flashbax'] / seconds['floor'])}: the most any buffer "
    f"could give this loop; jaxbuf's route spends "
    f"{harness.ratio_text(above('jaxbuf') / above('flashbax'))} of flashbax's time above it"
  )
  verdicts.print("verdicts")
  harness.print_load_average_after()


if __name__ == "__main__":
  main()
