"""Pixel replay (issue 21): bytes per transition, a real 1M fill, fused speed.

Shape key: N envs (8), S sample size (32), C capacity, 84x84 uint8 frames,
stacks of 4.

* `bytes`: bytes per transition held at C = 1M, side by side. jaxbuf
  (`frame_stack_replay`) and flashbax's flat buffer (a stacked observation
  per item, next_obs read from the next item) from their states' array
  bytes (`jax.eval_shape`, nothing allocated); SB3's `ReplayBuffer` in both
  modes from the arrays it allocates at C = 10k, scaled (its per-transition
  layout does not depend on C); cpprb's `stack_compress` (with `next_of`)
  from the resident set a fresh process adds filling C = 100k, scaled.
* `fill`: a fresh process fills a 1M-step jaxbuf buffer with synthetic
  frames (a jitted, donated add of 8 envs x 1000 steps per call) and prints
  its peak memory (the resident set on CPU, the device allocator's peak on
  an accelerator) and the median time of one jitted sample of 32 stacks
  from the full buffer, called from Python.
* `speed`: one jitted program of 100 fused steps (add one step per env,
  sample 32 stacked transitions), jaxbuf against flashbax's flat buffer of
  stacked observations, interleaved, at the largest capacity both fit here.

Usage:
  python benchmarks/peers/bench_frames.py                  # bytes, fill, speed
  python benchmarks/peers/bench_frames.py --cases speed --parts   # + add, sample alone
  python benchmarks/peers/bench_frames.py --cases speed --against d471062  # + jaxbuf then
"""

import argparse
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
from benchmarks.common import revisions
import jaxbuf

FRAME = (84, 84)
NUM_STACK = 4
NUM_ENVS = 8
SAMPLE = 32
MILLION = 1_000_000


def frame_step():
  return {
    "obs": jnp.zeros(FRAME, jnp.uint8),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }


def stacked_item():
  return {
    "obs": jnp.zeros((*FRAME, NUM_STACK), jnp.uint8),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "done": jnp.bool_(False),
  }


def tree_bytes(tree) -> int:
  return sum(
    math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
  )


def checksum(stacks: jax.Array) -> jax.Array:
  """Reads every byte of a batch of stacks, as a learner would: a slice of
  the batch would let XLA gather only that slice."""
  return jnp.sum(stacks, dtype=jnp.int32)


def jaxbuf_buffer(capacity, stack_axis=-1):
  return jaxbuf.frame_stack_replay(NUM_ENVS, capacity, NUM_STACK, n_step=3, stack_axis=stack_axis)


def flashbax_buffer(capacity):
  import flashbax  # pylint: disable=import-outside-toplevel

  return flashbax.make_flat_buffer(
    max_length=capacity, min_length=SAMPLE, sample_batch_size=SAMPLE, add_batch_size=NUM_ENVS
  )


def sb3_bytes_per_transition(optimize: bool, capacity: int = 10_000) -> float:
  import gymnasium  # pylint: disable=import-outside-toplevel
  from stable_baselines3.common import buffers  # pylint: disable=import-outside-toplevel

  observation_space = gymnasium.spaces.Box(0, 255, (NUM_STACK, *FRAME), np.uint8)
  buffer = buffers.ReplayBuffer(
    capacity,
    observation_space,
    gymnasium.spaces.Discrete(6),
    device="cpu",
    n_envs=1,
    optimize_memory_usage=optimize,
    handle_timeout_termination=not optimize,
  )
  arrays = [value for value in vars(buffer).values() if isinstance(value, np.ndarray)]
  return sum(array.nbytes for array in arrays) / capacity


def cpprb_child(capacity: int) -> dict:
  """In a fresh process: resident bytes cpprb's stack_compress buffer adds."""
  import cpprb  # pylint: disable=import-outside-toplevel

  start = harness.resident_bytes()
  buffer = cpprb.ReplayBuffer(
    capacity,
    {
      "obs": {"shape": (*FRAME, NUM_STACK), "dtype": np.uint8},
      "act": {"dtype": np.int32},
      "rew": {},
      "done": {},
    },
    next_of="obs",
    stack_compress="obs",
  )
  rng = np.random.default_rng(0)
  frames = rng.integers(0, 255, (1024 + NUM_STACK, *FRAME), np.uint8)
  stack = np.lib.stride_tricks.sliding_window_view(
    frames, NUM_STACK, axis=0
  )  # [1024 + 1, 84, 84, 4], consecutive frames
  for _start_step in range(0, capacity, 1024):
    # One episode's consecutive stacks, as an env would give them.
    buffer.add(
      obs=stack[:1024],
      next_obs=stack[1:1025],
      act=np.zeros(1024, np.int32),
      rew=np.zeros(1024),
      done=np.zeros(1024),
    )
  buffer.on_episode_end()
  return {"bytes_per_transition": (harness.resident_bytes() - start) / capacity}


def fill_child(capacity: int) -> dict:
  """In a fresh process: fill a jaxbuf pixel buffer; its peak memory (the
  device allocator's on an accelerator, the resident set on CPU) and the
  cost of one jitted sample of `SAMPLE` stacks from it."""
  buffer = jaxbuf_buffer(capacity)
  chunk_length = min(1000, capacity // NUM_ENVS)
  memory = harness.PeakMemory().start()

  def add(state, start):
    frames = (start + jnp.arange(chunk_length, dtype=jnp.int32)) % 251
    frames = jnp.broadcast_to(
      frames.astype(jnp.uint8)[None, :, None, None], (NUM_ENVS, chunk_length, *FRAME)
    )
    steps = {
      "obs": frames,
      "action": jnp.zeros((NUM_ENVS, chunk_length), jnp.int32),
      "reward": jnp.ones((NUM_ENVS, chunk_length), jnp.float32),
      "terminated": jnp.zeros((NUM_ENVS, chunk_length), bool),
    }
    ends = (jnp.arange(chunk_length) % 997 == 0)[None, :].repeat(NUM_ENVS, 0)
    return jaxbuf.frames.add(state, steps, episode_end=ends, num_stack=NUM_STACK, n_step=3)

  add = jax.jit(add, donate_argnums=0)
  state = buffer.init(frame_step())
  for start in range(0, capacity // NUM_ENVS, chunk_length):
    state = add(state, jnp.int32(start))
  harness.block(state)
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  sample_seconds = harness.time_call(
    lambda: checksum(buffer.sample(state, next(keys), SAMPLE).items.obs), repeats=20, warmup=2
  )
  memory.stop()
  held = int(np.sum(state.steps_held))
  return {
    "capacity": capacity,
    "steps_held": held,
    "sampleable": int(np.sum(state.window_counts)),
    "state_bytes": tree_bytes(state),
    "measured": memory.measured,
    "baseline_bytes": memory.baseline,
    "peak_bytes": memory.peak,
    "sample_seconds": sample_seconds,
  }


def bytes_case() -> None:
  print("\n== bytes per transition, 84x84 uint8, stack 4, C = 1M ==")
  jaxbuf_state = jax.eval_shape(jaxbuf_buffer(MILLION).init, frame_step())
  flashbax_state = jax.eval_shape(flashbax_buffer(MILLION).init, stacked_item())
  rows = [
    ("jaxbuf frame_stack_replay", tree_bytes(jaxbuf_state) / MILLION, "state arrays (eval_shape)"),
    ("flashbax flat buffer", tree_bytes(flashbax_state) / MILLION, "state arrays (eval_shape)"),
  ]
  for optimize in (False, True):
    try:
      value = sb3_bytes_per_transition(optimize)
      how = "arrays allocated at C = 10k"
    except ImportError:
      # Its documented layout: obs and next_obs [C, 4, 84, 84] uint8 (next_obs
      # dropped with optimize_memory_usage), actions int64, rewards, dones
      # and timeouts float32.
      value = NUM_STACK * math.prod(FRAME) * (1 if optimize else 2) + 8 + 12
      how = "documented layout (not installed)"
    rows.append((f"SB3 ReplayBuffer optimize_memory_usage={optimize}", value, how))
  cpprb = harness.run_child(__file__, ["--child", "cpprb", "100000"])
  rows.append(
    (
      "cpprb stack_compress + next_of",
      cpprb.get("bytes_per_transition"),
      "RSS added filling C = 100k",
    )
  )
  harness.print_table(
    [("buffer", -46), ("bytes/transition", 17), ("vs jaxbuf", 10), ("measured from", -30)],
    [
      (
        name,
        "-" if value is None else f"{value:,.0f}",
        harness.ratio_text(harness.ratio(value, rows[0][1])),
        how,
      )
      for name, value, how in rows
    ],
  )
  verdict = "PASS" if rows[0][1] <= 7200 else "FAIL"
  print(f"{verdict}: jaxbuf {rows[0][1]:,.1f} bytes per transition (goal <= 7,200)")


def fill_case(capacity: int) -> None:
  print(f"\n== a real fill: {capacity:,} steps of 84x84 uint8 frames ==")
  result = harness.run_child(__file__, ["--child", "fill", str(capacity)], timeout=3600)
  if "error" in result:
    print("fill failed:", result["error"])
    return
  print(json.dumps(result))
  peak = result["peak_bytes"] / 2**30
  print(
    f"{'PASS' if peak < 8 else 'FAIL'}: peak {result['measured']} "
    f"{peak:.2f} GiB (state {result['state_bytes'] / 2**30:.2f} GiB, "
    "goal < 8 GiB)"
  )
  print(
    f"info: sample of {SAMPLE} stacks of {NUM_STACK} from "
    f"{result['steps_held']:,} frames: "
    f"{harness.microseconds(result['sample_seconds'])} us per call"
  )


def stack_loop(frames, steps_per_call: int, mode: str = "fused"):
  """`(state, key) -> (state, checksum)`: `steps_per_call` steps of adding
  one frame per env and sampling S stacked transitions (`mode` "add" or
  "sample": that half alone), in one `lax.scan`."""

  def loop(state, key):
    def body(carry, t):
      state, acc = carry
      step = {
        "obs": jnp.full((NUM_ENVS, *FRAME), t % 251, jnp.uint8),
        "action": jnp.zeros(NUM_ENVS, jnp.int32),
        "reward": jnp.ones(NUM_ENVS, jnp.float32),
        "terminated": jnp.zeros(NUM_ENVS, bool),
      }
      if mode != "sample":
        state = frames.add(state, step, episode_end=jnp.full(NUM_ENVS, t % 500 == 0))
      if mode != "add":
        batch = frames.sample(state, jax.random.fold_in(key, t), SAMPLE)
        acc = acc + checksum(batch.items.obs) + checksum(batch.items.next_obs)
      return (state, acc), None

    (state, acc), _ = jax.lax.scan(body, (state, jnp.int32(0)), jnp.arange(steps_per_call))
    return state, acc

  return loop


def stored_stack_loop(flat, steps_per_call: int, mode: str = "fused"):
  """`stack_loop` for flashbax's flat buffer of stored stacks."""

  def loop(state, key):
    def body(carry, t):
      state, acc = carry
      item = {
        "obs": jnp.full((NUM_ENVS, *FRAME, NUM_STACK), t % 251, jnp.uint8),
        "action": jnp.zeros(NUM_ENVS, jnp.int32),
        "reward": jnp.ones(NUM_ENVS, jnp.float32),
        "done": jnp.zeros(NUM_ENVS, bool),
      }
      if mode != "sample":
        state = flat.add(state, item)
      if mode != "add":
        batch = flat.sample(state, jax.random.fold_in(key, t))
        acc = (
          acc + checksum(batch.experience.first["obs"]) + checksum(batch.experience.second["obs"])
        )
      return (state, acc), None

    (state, acc), _ = jax.lax.scan(body, (state, jnp.int32(0)), jnp.arange(steps_per_call))
    return state, acc

  return loop


def speed_case(
  capacity: int, repeats: int, parts: bool = False, against: str | None = None
) -> None:
  print(
    f"\n== fused add + sample {SAMPLE} stacked transitions, C = "
    f"{capacity:,}, {NUM_ENVS} envs, 100 steps per call =="
  )
  flat = flashbax_buffer(capacity)
  steps_per_call = 100

  # Stacks [S, 84, 84, 4] (the layout flashbax stores) and [S, 4, 84, 84]
  # (channels first: no transpose after the gather).
  layouts = {
    "jaxbuf": jaxbuf_buffer(capacity),
    "jaxbuf stack_axis=0": jaxbuf_buffer(capacity, stack_axis=0),
  }
  if against:  # jaxbuf as it was at that revision, its default layout
    with revisions.bound(sys.modules[__name__], revisions.jaxbuf_at(against)):
      layouts[revisions.contender_name(against)] = jaxbuf_buffer(capacity)
  runs = {
    name: jax.jit(stack_loop(buffer, steps_per_call), donate_argnums=0)
    for name, buffer in layouts.items()
  }
  runs["flashbax"] = jax.jit(stored_stack_loop(flat, steps_per_call), donate_argnums=0)
  states = {name: buffer.init(frame_step()) for name, buffer in layouts.items()}
  states["flashbax"] = flat.init(stacked_item())
  if parts:
    # The add alone and the sample alone (of a buffer filled by the warm-up
    # adds), for jaxbuf's default layout and flashbax.
    for mode in ("add", "sample"):
      runs[f"jaxbuf {mode} only"] = jax.jit(
        stack_loop(layouts["jaxbuf"], steps_per_call, mode), donate_argnums=0
      )
      runs[f"flashbax {mode} only"] = jax.jit(
        stored_stack_loop(flat, steps_per_call, mode), donate_argnums=0
      )
      states[f"jaxbuf {mode} only"] = layouts["jaxbuf"].init(frame_step())
      states[f"flashbax {mode} only"] = flat.init(stacked_item())
    for name in [n for n in runs if n.endswith("sample only")]:
      fill = runs["jaxbuf" if name.startswith("jaxbuf") else "flashbax"]
      states[name], _ = fill(states[name], jax.random.key(0))

  for _ in range(2):  # warm every loop past a sampleable state
    for name, run in runs.items():
      states[name], _ = run(states[name], jax.random.key(0))

  def call(name):
    def thunk():
      states[name], acc = runs[name](states[name], jax.random.key(1))
      return acc

    return thunk

  times = harness.time_interleaved({name: call(name) for name in runs}, repeats=repeats)
  print(
    f"state bytes: jaxbuf {tree_bytes(states['jaxbuf']) / 2**20:,.0f} "
    f"MiB, flashbax {tree_bytes(states['flashbax']) / 2**20:,.0f} MiB"
  )
  harness.print_table(
    [("library", -10), ("us per fused step", 18), ("vs jaxbuf", 10)],
    [
      (
        name,
        harness.microseconds(seconds / steps_per_call),
        harness.ratio_text(harness.ratio(seconds, times["jaxbuf"])),
      )
      for name, seconds in times.items()
    ],
  )
  for name, seconds in times.items():
    print(
      f"info  fused add + sample, C={capacity:,}: {name} "
      f"{harness.microseconds(seconds / steps_per_call)} us per step "
      f"({harness.ratio_text(harness.ratio(seconds, times['jaxbuf']))} "
      "jaxbuf's)"
    )


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    child = {"cpprb": cpprb_child, "fill": fill_child}[sys.argv[2]]
    print(json.dumps(child(int(sys.argv[3]))))
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=["bytes", "fill", "speed"])
  parser.add_argument("--fill-capacity", type=int, default=MILLION)
  parser.add_argument("--speed-capacity", type=int, default=100_000)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument(
    "--parts", action="store_true", help="also time the add alone and the sample alone"
  )
  parser.add_argument(
    "--against",
    metavar="REVISION",
    help="speed: also time jaxbuf as it was at this git revision (jaxbuf@REVISION), interleaved",
  )
  args = parser.parse_args()
  harness.print_machine()
  if "bytes" in args.cases:
    bytes_case()
  if "fill" in args.cases:
    fill_case(args.fill_capacity)
  if "speed" in args.cases:
    speed_case(args.speed_capacity, args.repeats, args.parts, args.against)


if __name__ == "__main__":
  main()
