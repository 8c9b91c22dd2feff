"""DQN on a host-stepped gymnasium env: SB3, jaxbuf (recipe, natural), cpprb.

One process, one after another and round-robin over the repeats, so a
change in the load of a shared machine hits every contender alike. Each
trains a DQN on gymnasium's CartPole-v1, 4 envs, for the same env steps,
with the same network (120, 84) and hyperparameters (CleanRL's dqn.py; one
learner update per 8 env steps):

* sb3: Stable-Baselines3's `DQN` (PyTorch, one thread), `train_freq=2`
  vector steps.
  Its loss is the Huber loss (fixed in SB3) where ours is a squared error;
  the TD target (target network's max), optimizer, gradient clipping (10),
  exploration and target copies (every 500 env steps) are the same.
* recipe: examples/gymnasium_dqn.py, one donated jitted step per env step.
* natural: examples/gymnasium_dqn.py --natural, plain `buffer.add` from
  NumPy, `buffer.sample(..., step=)`, a jitted learner, `update_priorities`.
* cpprb: the same natural loop with a cpprb `ReplayBuffer` behind the same
  calls (NumPy in, NumPy out; its learner input crosses to JAX per update).

Env steps per second count the whole training loop, compilation included
(for jaxbuf; SB3 has none). Final return: the mean return of the episodes
that ended in the last 10% of env steps.

Usage:
  python benchmarks/peers/bench_host_dqn.py            # 5e5 env steps each, minutes
  python benchmarks/peers/bench_host_dqn.py --quick    # 2e4 env steps each
  python benchmarks/peers/bench_host_dqn.py --seeds 4  # seeds 0-3: final returns
                                                 # compared over seeds
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness

from examples import gymnasium_dqn  # noqa: E402

CONTENDERS = ("sb3", "recipe", "natural", "cpprb")
PACKAGES = harness.PACKAGES + ("gymnasium", "stable-baselines3", "torch")


def cpprb_buffer(capacity: int):
  """A cpprb `ReplayBuffer` behind `jaxbuf.Buffer`'s calls (state = the
  cpprb object), so it runs in the natural loop unchanged."""
  import cpprb  # pylint: disable=import-outside-toplevel
  import jaxbuf  # pylint: disable=import-outside-toplevel

  shapes = {}

  def init(example):
    shapes.update({name: np.shape(leaf) for name, leaf in example._asdict().items()})
    return cpprb.ReplayBuffer(
      capacity,
      {
        name: {"shape": shape or 1, "dtype": np.asarray(leaf).dtype}
        for (name, shape), leaf in zip(shapes.items(), example)
      },
    )

  def add(replay, items):
    replay.add(**items._asdict())
    return replay

  def sample(replay, key, batch_size, *, step=None):
    del key, step  # cpprb draws from its own generator
    batch = replay.sample(batch_size)
    items = jaxbuf.Transition(
      **{name: batch[name].reshape((batch_size, *shape)) for name, shape in shapes.items()}
    )
    return jaxbuf.ReplaySample(
      items=items,
      indices=np.zeros(batch_size, np.int32),
      weights=np.ones(batch_size, np.float32),
      item_ids=np.zeros(batch_size, np.uint32),
    )

  def update_priorities(replay, indices, priorities, item_ids=None):
    del indices, priorities, item_ids  # uniform: nothing to update
    return replay

  return jaxbuf.Buffer(
    init=init,
    add=add,
    sample=sample,
    update_priorities=update_priorities,
    can_sample=lambda replay, batch_size: replay.get_stored_size() >= batch_size,
    clear=lambda replay: replay.clear() or replay,
    # Says it holds items, as uniform replay does, to
    # the jaxbuf.VectorEnvRecorder that fills it.
    kind=jaxbuf.uniform_replay(capacity).kind,
  )


def run_sb3(config: gymnasium_dqn.Config) -> dict:
  """SB3's DQN with `config`'s settings: env steps/s and final return."""
  # pylint: disable=import-outside-toplevel
  import torch
  from stable_baselines3 import DQN
  from stable_baselines3.common.callbacks import BaseCallback
  from stable_baselines3.common.env_util import make_vec_env

  class EpisodeReturns(BaseCallback):
    def __init__(self):
      super().__init__()
      self.ended = []  # (env step, return)

    def _on_step(self) -> bool:
      for info in self.locals["infos"]:
        if "episode" in info:
          self.ended.append((self.num_timesteps, info["episode"]["r"]))
      return True

  envs = make_vec_env(config.env_id, n_envs=config.num_envs, seed=config.seed)
  model = DQN(
    "MlpPolicy",
    envs,
    learning_rate=config.learning_rate,
    buffer_size=config.buffer_size,
    learning_starts=config.learning_starts,
    batch_size=config.batch_size,
    tau=1.0,
    gamma=config.gamma,
    train_freq=max(config.train_frequency // config.num_envs, 1),
    gradient_steps=1,
    target_update_interval=config.target_update_interval,
    exploration_fraction=config.epsilon_fraction,
    exploration_initial_eps=config.epsilon_start,
    exploration_final_eps=config.epsilon_end,
    max_grad_norm=config.max_grad_norm,
    policy_kwargs={"net_arch": [config.hidden_size, config.hidden_size * 7 // 10]},
    seed=config.seed,
    device="cpu",
  )
  returns = EpisodeReturns()
  # One thread: on a small MLP PyTorch's thread pool only adds contention
  # (on a loaded 2-core machine SB3 ran 30x slower with the default).
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  start = time.perf_counter()
  model.learn(config.total_steps, callback=returns)
  seconds = time.perf_counter() - start
  torch.set_num_threads(threads)
  tail = [r for step, r in returns.ended if step >= 0.9 * config.total_steps]
  return dict(
    steps_per_second=config.total_steps / seconds,
    final_mean_return=float(np.mean(tail)) if tail else float("nan"),
  )


def run(name: str, config: gymnasium_dqn.Config) -> dict:
  if name == "sb3":
    return run_sb3(config)
  if name == "recipe":
    return gymnasium_dqn.train(config)
  natural = gymnasium_dqn.Config(**{**config.__dict__, "natural": True})
  if name == "natural":
    return gymnasium_dqn.train(natural)
  return gymnasium_dqn.train(natural, buffer=cpprb_buffer(config.buffer_size))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--total-steps", type=int, default=None)
  parser.add_argument(
    "--repeats", type=int, default=1, help="runs per contender with the same seed (speed)"
  )
  parser.add_argument(
    "--seeds",
    type=int,
    default=1,
    help="seeds 0 .. N-1, each run once per repeat; one seed's final return says little",
  )
  parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
  args = parser.parse_args()
  contenders = tuple(args.contenders)
  harness.print_machine(PACKAGES)
  total_steps = args.total_steps or (20_000 if args.quick else 500_000)
  config = gymnasium_dqn.Config(
    total_steps=total_steps, progress=False, learning_starts=min(10_000, total_steps // 10)
  )
  results = {name: [] for name in contenders}
  for repeat in range(args.repeats):
    for seed in range(args.seeds):
      for name in contenders:
        result = run(name, dataclasses.replace(config, seed=seed))
        results[name].append(result)
        print(
          f"repeat {repeat} seed {seed}: {name:8s} "
          f"{result['steps_per_second']:8,.0f} env steps/s, final return "
          f"{result['final_mean_return']:.1f} "
          f"(load {harness.load_average()})",
          flush=True,
        )

  def median(name, field):
    return float(np.median([r[field] for r in results[name]]))

  def final_returns(name):
    values = [r["final_mean_return"] for r in results[name]]
    return (
      f"{np.mean(values):.1f} (min {np.min(values):.1f})" if len(values) > 1 else f"{values[0]:.1f}"
    )

  sb3_speed = median("sb3", "steps_per_second") if "sb3" in results else None
  print(
    f"\n{total_steps:,} env steps each, {args.seeds} seed(s) x "
    f"{args.repeats} repeat(s); env steps/s: medians; final return: mean "
    f"over runs; load at end {harness.load_average()}"
  )
  harness.print_table(
    [("contender", -9), ("env steps/s", 12), ("vs SB3", 8), ("final return", 22)],
    [
      (
        name,
        f"{median(name, 'steps_per_second'):,.0f}",
        harness.ratio_text(median(name, "steps_per_second") / sb3_speed) if sb3_speed else "-",
        final_returns(name),
      )
      for name in contenders
    ],
  )
  if sb3_speed is None or not {"recipe", "natural", "cpprb"} <= set(results):
    return
  verdicts = harness.Verdicts()
  verdicts.judge("recipe env steps/s vs SB3", median("recipe", "steps_per_second") / sb3_speed, 1.3)
  verdicts.judge(
    "natural env steps/s vs SB3", median("natural", "steps_per_second") / sb3_speed, 1.0
  )
  verdicts.info(
    "cpprb in the natural loop vs SB3: "
    + harness.ratio_text(median("cpprb", "steps_per_second") / sb3_speed)
  )
  verdicts.print("Verdicts")


if __name__ == "__main__":
  main()
