"""Hindsight replay: sample cost and bytes per transition, side by side.

  python benchmarks/peers/bench_hindsight.py                 # capacity 1M
  python benchmarks/peers/bench_hindsight.py --capacity 100000 --repeats 5
  python benchmarks/peers/bench_hindsight.py --before bec42e4  # and that commit's

`--before REV` adds the `hindsight_replay` of `jaxbuf/_src/streams/hindsight.py`
as it was at git revision REV (with its factory from `factories.py` at REV
once the factories moved there; the rest of the library as it is now),
holding the same steps, to the interleaved calls: a change's before and
after side by side in one process.

The transitions are FetchReach-shaped (gymnasium-robotics): observation
float32 (10,), achieved and desired goal float32 (3,), action float32 (4,),
episodes of 50 steps. Both jaxbuf buffers hold the same transitions:

* `hindsight_replay` (16 envs, strategy "future", relabel 0.8): the per-env
  streams of steps, one extra step per episode for its final observation;
  a sample draws transitions, draws goals and recomputes the rewards of the
  relabelled rows (`reward_fn`: distance above 0.05).
* `uniform_replay` of `(obs, action, reward, next_obs, terminated)` items:
  a plain gather, no relabelling. Target: HER sample <= 1.5x of it.

SB3's `HerReplayBuffer.sample` (stable-baselines3, torch on CPU, one
thread) is timed per call from Python after the jaxbuf pair, at the same
capacity, filled by writing its arrays
directly in the layout its `add` leaves (`ep_start`, `ep_length`), since a
million Python `add` calls would take minutes. Its rewards go through
`env_method("compute_reward")` of a one-env `DummyVecEnv`, as in training.

Bytes per transition: jaxbuf's from the state's arrays (steps, bookkeeping
and sum tree) times 51 / 50 (the final-observation step); SB3's from its
allocated arrays (observations and next observations both stored); cpprb's
`HindsightReplayBuffer` from its documented layout: every transition is
added 1 + `additional_goals` (default 4) times, with obs, act, next_obs,
goal and rew, so its bytes per env transition are (1 + k) rows.
"""

import argparse
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
import jaxbuf  # noqa: E402
from benchmarks.common import harness

OBS, GOAL, ACTION, EPISODE = 10, 3, 4, 50
NUM_ENVS = 16


def reward_fn(achieved_goal, desired_goal):
  distance = jnp.linalg.norm(achieved_goal - desired_goal, axis=-1)
  return -(distance > 0.05).astype(jnp.float32)


def goal_obs(rng, shape):
  return {
    "observation": rng.standard_normal(shape + (OBS,), np.float32),
    "achieved_goal": rng.standard_normal(shape + (GOAL,), np.float32),
    "desired_goal": rng.standard_normal(shape + (GOAL,), np.float32),
  }


def tree_bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def module_at(revision: str, path: str, **names):
  """The file `path` as it was at git `revision`, run as a module with
  `names` set in it first."""
  root = pathlib.Path(__file__).resolve().parents[2]
  source = subprocess.run(
    ["git", "show", f"{revision}:{path}"],
    cwd=root,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  if names:
    # `from jaxbuf._src.streams import hindsight` and names imported from
    # it: the revision's module, not the library's.
    for name in names:
      source = source.replace(f"from jaxbuf._src.streams import {name}\n", "")
      source = re.sub(
        rf"from jaxbuf\._src\.streams\.{name} import (.+)\n",
        lambda match, name=name: "".join(
          f"{imported} = {name}.{imported}\n" for imported in match.group(1).split(", ")
        ),
        source,
      )
  file = pathlib.Path(tempfile.mkdtemp()) / f"{pathlib.Path(path).stem}_{revision}.py"
  file.write_text(source)
  spec = importlib.util.spec_from_file_location(file.stem, file)
  module = importlib.util.module_from_spec(spec)
  vars(module).update(names)
  spec.loader.exec_module(module)
  return module


def hindsight_replay_at(revision: str):
  """`hindsight_replay` as it was at git `revision`, over that revision's
  `jaxbuf/_src/streams/hindsight.py` (the rest of the library as it is
  now). Since issue 31 the factory is in `factories.py`, loaded from the
  same revision over that hindsight module."""
  hindsight = module_at(revision, "jaxbuf/_src/streams/hindsight.py")
  if hasattr(hindsight, "hindsight_replay"):
    return hindsight.hindsight_replay
  factories = module_at(revision, "jaxbuf/_src/streams/factories.py", hindsight=hindsight)
  return factories.hindsight_replay


def her_state(capacity: int, make=jaxbuf.hindsight_replay):
  buffer = make(NUM_ENVS, capacity, reward_fn)
  rng = np.random.default_rng(0)
  per_env = capacity // NUM_ENVS
  steps = {
    "obs": goal_obs(rng, (NUM_ENVS, per_env)),
    "action": rng.standard_normal((NUM_ENVS, per_env, ACTION), np.float32),
    "reward": np.zeros((NUM_ENVS, per_env), np.float32),
    "terminated": np.zeros((NUM_ENVS, per_env), bool),
  }
  # Episodes of 50 transitions: 51 steps, the last the final observation.
  ends = (np.arange(per_env) % (EPISODE + 1) == EPISODE)[None].repeat(NUM_ENVS, 0)
  state = buffer.init(jax.tree.map(lambda x: x[0, 0], steps))
  return buffer, buffer.add(state, steps, episode_end=ends)


def item_state(capacity: int):
  buffer = jaxbuf.uniform_replay(capacity)
  rng = np.random.default_rng(1)
  items = {
    "obs": goal_obs(rng, (capacity,)),
    "action": rng.standard_normal((capacity, ACTION), np.float32),
    "reward": np.zeros(capacity, np.float32),
    "next_obs": goal_obs(rng, (capacity,)),
    "terminated": np.zeros(capacity, bool),
  }
  state = buffer.init(jax.tree.map(lambda x: x[0], items))
  return buffer, buffer.add(state, items)


def sb3_buffer(capacity: int):
  """SB3's HerReplayBuffer filled with episodes of 50 steps; None if absent."""
  try:
    import gymnasium as gym  # pylint: disable=import-outside-toplevel
    from stable_baselines3 import HerReplayBuffer  # pylint: disable=import-outside-toplevel
    from stable_baselines3.common.vec_env import DummyVecEnv  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  # torch's own thread pool would contend with XLA's for the cores while
  # the libraries alternate.
  torch.set_num_threads(1)

  class GoalEnv(gym.Env):
    def __init__(self):
      box = lambda n: gym.spaces.Box(-np.inf, np.inf, (n,), np.float32)
      self.observation_space = gym.spaces.Dict(
        {"observation": box(OBS), "achieved_goal": box(GOAL), "desired_goal": box(GOAL)}
      )
      self.action_space = gym.spaces.Box(-1, 1, (ACTION,), np.float32)

    def compute_reward(self, achieved_goal, desired_goal, _info):
      distance = np.linalg.norm(achieved_goal - desired_goal, axis=-1)
      return -(distance > 0.05).astype(np.float32)

  env = DummyVecEnv([GoalEnv])
  buffer = HerReplayBuffer(
    capacity,
    env.observation_space,
    env.action_space,
    env,
    device="cpu",
    n_sampled_goal=4,
    goal_selection_strategy="future",
  )
  rng = np.random.default_rng(2)
  for _name, column in (*buffer.observations.items(), *buffer.next_observations.items()):
    column[:] = rng.standard_normal(column.shape).astype(column.dtype)
  positions = np.arange(capacity)
  buffer.ep_start[:, 0] = positions - positions % EPISODE
  buffer.ep_length[:, 0] = EPISODE
  buffer.full, buffer.pos = True, 0
  return buffer


def sb3_bytes_per_transition() -> float | None:
  buffer = sb3_buffer(1000)
  if buffer is None:
    return None
  arrays = [
    *buffer.observations.values(),
    *buffer.next_observations.values(),
    buffer.actions,
    buffer.rewards,
    buffer.dones,
    buffer.timeouts,
    buffer.ep_start,
    buffer.ep_length,
  ]
  return sum(a.nbytes for a in arrays) / 1000


def cpprb_bytes_per_transition(additional_goals: int = 4) -> float:
  """cpprb HindsightReplayBuffer rows (obs, act, next_obs, goal, rew: float32
  by default) per env transition: 1 + additional_goals rows."""
  row = 4 * (2 * (OBS + GOAL) + ACTION + GOAL + 1)
  return float(row * (1 + additional_goals))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--capacity", type=int, default=1_000_000)
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--no-sb3", action="store_true", help="leave SB3 out of the timing")
  parser.add_argument(
    "--before", metavar="REV", help="also time hindsight.py as at git revision REV"
  )
  args = parser.parse_args()
  harness.print_machine(harness.PACKAGES + ("stable_baselines3", "torch"))
  capacity = args.capacity - args.capacity % NUM_ENVS
  her, her_held = her_state(capacity)
  items, items_held = item_state(capacity)
  keys = iter(jax.random.split(jax.random.key(0), 10_000))
  calls = {
    "hindsight_replay": lambda: her.sample(her_held, next(keys), args.batch_size),
    "uniform_replay (items)": lambda: items.sample(items_held, next(keys), args.batch_size),
  }
  if args.before:
    before, before_held = her_state(capacity, hindsight_replay_at(args.before))
    calls[f"hindsight_replay at {args.before}"] = lambda: before.sample(
      before_held, next(keys), args.batch_size
    )
  times = harness.time_interleaved(calls, repeats=args.repeats, warmup=2)
  # SB3 is timed after, not interleaved: torch's threads, once woken, slowed
  # XLA's next calls several-fold on this 2-core machine.
  sb3 = None if args.no_sb3 else sb3_buffer(capacity)
  if sb3 is not None:
    times["SB3 HerReplayBuffer"] = harness.time_call(
      lambda: sb3.sample(args.batch_size), repeats=args.repeats
    )
  print(
    f"\nsample of {args.batch_size} at capacity {capacity:,} (median of "
    f"{args.repeats}; the jaxbuf calls interleaved), microseconds per call"
  )
  harness.print_table(
    [("buffer", -32), ("us", 10), ("vs HER", 8)],
    [
      (
        name,
        harness.microseconds(seconds),
        harness.ratio_text(harness.ratio(seconds, times["hindsight_replay"])),
      )
      for name, seconds in times.items()
    ],
  )

  transitions = capacity * EPISODE / (EPISODE + 1)
  her_bytes = tree_bytes(her_held) / transitions
  item_bytes = tree_bytes(items_held) / capacity
  sb3_bytes = sb3_bytes_per_transition()
  cpprb_bytes = cpprb_bytes_per_transition()
  print("\nbytes per transition held (FetchReach shapes, episodes of 50)")
  harness.print_table(
    [("buffer", -34), ("bytes", 8), ("vs HER", 8)],
    [
      (
        name,
        "-" if value is None else f"{value:.1f}",
        harness.ratio_text(harness.ratio(value, her_bytes)),
      )
      for name, value in (
        ("jaxbuf hindsight_replay", her_bytes),
        ("jaxbuf uniform_replay (items)", item_bytes),
        ("SB3 HerReplayBuffer", sb3_bytes),
        ("cpprb HindsightReplayBuffer (k=4)", cpprb_bytes),
      )
    ],
  )

  verdicts = harness.Verdicts()
  for name, seconds in times.items():
    verdicts.info(
      f"{name} sample of {args.batch_size}, C={capacity:,}: "
      f"{harness.microseconds(seconds)} us per call"
    )
  verdicts.judge(
    "HER sample / item replay sample",
    harness.ratio(times["hindsight_replay"], times["uniform_replay (items)"]),
    1.5,
    higher_is_better=False,
  )
  if args.before:
    before = harness.ratio(
      times[f"hindsight_replay at {args.before}"], times["uniform_replay (items)"]
    )
    verdicts.info(f"HER sample at {args.before} / item replay sample: {harness.ratio_text(before)}")
  if sb3 is not None:
    sb3_ratio = harness.ratio(times["SB3 HerReplayBuffer"], times["hindsight_replay"])
    verdicts.info(f"SB3 HerReplayBuffer.sample / jaxbuf: {harness.ratio_text(sb3_ratio)}")
  verdicts.print("verdicts")
  print(f"\nload average at the end: {harness.load_average()}")


if __name__ == "__main__":
  main()
