"""Per-call cost of `jaxbuf.VectorEnvRecorder` against a plain `buffer.add`.

A 4-env CartPole step (obs float32 [4, 4], action int64 [4], reward float64
[4], terminated and truncated bool [4]), made up in NumPy so that only
jaxbuf's calls are timed, never the env. Item replay (uniform, capacity
10,000): `buffer.add` of the `jaxbuf.Transition` batch a user builds by hand
(final observations already restored) against `recorder.add` of the raw
step: with no episode end; with env 0 ending every 2nd step (NEXT_STEP: a
reset row dropped every 2nd call, so two add batch sizes; SAME_STEP: a final
observation restored every 2nd call); and `recorder.record` alone (the host
bookkeeping, no add). Stream replay (sequence, 4 envs, 10,000 steps):
`buffer.add` of `jaxbuf.EpisodeStep` steps alone and with `mask=` and
`final_steps=` (what the recorder passes) against `recorder.add`. The floor
is a donated jitted identity on the item state. Dispatch only, as in
bench_host_calls.py: the last call's result is waited for. Microseconds per
call, the median of interleaved repeats of `--calls` calls each; with
`--best`, the least of them, which a loaded machine disturbs far less (on a
shared 2-core machine the medians of two runs differed by 2x, the least by
a few percent).

Usage:
  python benchmarks/features/bench_recorder.py [--calls 2000] [--repeats 7] [--best]
"""

import argparse
import itertools
import pathlib
import sys

import gymnasium as gym
import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf

NUM_ENVS = 4


def cartpole_envs(mode):
  return gym.make_vec(
    "CartPole-v1",
    num_envs=NUM_ENVS,
    vectorization_mode="sync",
    vector_kwargs={"autoreset_mode": mode},
  )


def made_up_steps(rng):
  """Two env steps: one where env 0 ends (terminated), one with no end."""

  def step(ended):
    terminated = np.zeros(NUM_ENVS, bool)
    terminated[0] = ended
    return (
      rng.integers(0, 2, NUM_ENVS),
      rng.normal(size=(NUM_ENVS, 4)).astype(np.float32),
      np.ones(NUM_ENVS),
      terminated,
      np.zeros(NUM_ENVS, bool),
    )

  return step(True), step(False)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument(
    "--best", action="store_true", help="the least time over the repeats, not the median"
  )
  args = parser.parse_args()
  harness.print_machine()
  rng = np.random.default_rng(0)
  ending, running = made_up_steps(rng)
  final_info = {
    "final_obs": np.array([np.ones(4, np.float32), None, None, None], dtype=object),
    "_final_obs": np.array([True, False, False, False]),
  }
  obs = rng.normal(size=(NUM_ENVS, 4)).astype(np.float32)
  items = jaxbuf.uniform_replay(10_000)
  streams = jaxbuf.sequence_replay(NUM_ENVS, 10_000, 2)
  modes = {"next": gym.vector.AutoresetMode.NEXT_STEP, "same": gym.vector.AutoresetMode.SAME_STEP}
  recorders = {
    (layout, mode): jaxbuf.VectorEnvRecorder(
      cartpole_envs(autoreset), items if layout == "items" else streams
    )
    for layout in ("items", "streams")
    for mode, autoreset in modes.items()
  }
  for recorder in recorders.values():
    recorder.reset(obs)
  item_example = recorders["items", "next"].example
  step_example = recorders["streams", "next"].example
  states = {}

  def carried(name, buffer, example, call):
    states[name] = buffer.init(example)

    def thunk():
      states[name] = call(states[name])
      return states[name]

    return thunk

  actions, next_obs, rewards, terminated, truncated = running
  transitions = jaxbuf.Transition(
    obs=obs,
    action=actions,
    reward=rewards.astype(np.float32),
    next_obs=next_obs,
    terminated=terminated,
    truncated=truncated,
  )
  steps = jaxbuf.EpisodeStep(
    obs=obs,
    action=actions,
    reward=rewards.astype(np.float32),
    terminated=terminated,
    truncated=truncated,
    last=np.zeros(NUM_ENVS, bool),
  )
  final_steps = steps._replace(last=terminated)
  every_env = np.ones(NUM_ENVS, bool)
  identity = jax.jit(lambda state: state, donate_argnums=0)

  def recorded(recorder, cycle):
    def call(state):
      step, info = next(cycle)
      return recorder.add(state, *step, info)

    return call

  no_end = itertools.repeat((running, {}))
  next_step_ends = itertools.cycle([(ending, {}), (running, {})])
  same_step_ends = itertools.cycle([(ending, final_info), (running, {})])
  record_cycle = itertools.cycle([(ending, {}), (running, {})])
  # Its own recorder: each recorder must see its steps in order.
  recording = jaxbuf.VectorEnvRecorder(cartpole_envs(modes["next"]), items)
  recording.reset(obs)

  def record_only():
    step, info = next(record_cycle)
    return recording.record(*step, info).items

  calls = {
    "items: buffer.add(Transition [4])": carried(
      "plain", items, item_example, lambda state: items.add(state, transitions)
    ),
    "items: recorder.add, no episode end": carried(
      "no end", items, item_example, recorded(recorders["items", "next"], no_end)
    ),
    "items: recorder.add NEXT_STEP, end 1 in 2": carried(
      "next", items, item_example, recorded(recorders["items", "next"], next_step_ends)
    ),
    "items: recorder.add SAME_STEP, end 1 in 2": carried(
      "same", items, item_example, recorded(recorders["items", "same"], same_step_ends)
    ),
    "items: recorder.record only (no add)": record_only,
    "items: jitted identity (floor)": carried("floor", items, item_example, identity),
    "streams: buffer.add(EpisodeStep [4])": carried(
      "plain steps", streams, step_example, lambda state: streams.add(state, steps)
    ),
    "streams: buffer.add(steps, mask=, final_steps=)": carried(
      "plain final",
      streams,
      step_example,
      lambda state: streams.add(state, steps, mask=every_env, final_steps=final_steps),
    ),
    "streams: recorder.add NEXT_STEP, end 1 in 2": carried(
      "streams next",
      streams,
      step_example,
      recorded(recorders["streams", "next"], itertools.cycle([(ending, {}), (running, {})])),
    ),
  }
  if args.best:
    harness.time_interleaved(calls, repeats=1, warmup=2)  # compiles
    rounds = [
      harness.time_interleaved(calls, repeats=1, warmup=0, number=args.calls)
      for _ in range(args.repeats)
    ]
    seconds = {name: min(times[name] for times in rounds) for name in calls}
  else:
    seconds = harness.time_interleaved(calls, repeats=args.repeats, warmup=2, number=args.calls)
  harness.print_table(
    [("call", -48), ("us per call", 12)],
    [(name, harness.microseconds(value)) for name, value in seconds.items()],
  )
  for name, value in seconds.items():
    print(f"info  {name}: {harness.microseconds(value)} us per call ({jax.default_backend()})")
  print(f"load average at end: {harness.load_average()}")


if __name__ == "__main__":
  main()
