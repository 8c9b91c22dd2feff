"""Storage tiers (issue 44): a disk-backed buffer bigger than RAM, and each tier's cost.

Shape key: N envs (8), S sample size, 84x84 uint8 frames, stacks of 4.

* `frames`: a disk-tier `frame_stack_replay` of `--frames-gib` GiB of
  frames under `--directory`, filled with adds of [N, T] steps, then sampled
  (S = 32 stacks of 4, uniform): fill rate, batches/s, and the process's
  anonymous resident memory (`RssAnon`, /proc/self/status) at its peak.
* `items`: a disk-tier `uniform_replay` of `--items-gib` GiB of state items
  (obs and next_obs float32[64] on disk, action and reward on the device),
  sampled with S = 256: batches/s. The files' pages are dropped from the
  page cache after the fill (`posix_fadvise(DONTNEED)`), so that the reads
  start from the disk.
* `prefetch`: a jitted learner step of a few milliseconds on each batch from
  the disk buffers, with and without `jaxbuf.Prefetcher`: the wait the step
  sees per batch.
* `device` (the device suite's part, for a GPU): the host tier's jitted
  sample of S = 256 state items (obs float32[16] in pinned host memory) at
  each of `--device-items` capacities against the device tier's (goal: at
  most 2x its time); a host-tier frame-stack buffer of `--device-frames`
  84x84 frames (10M: about 70 GB of the machine's host memory) filled and
  sampled (S = 32 stacks) inside jit; and pixel batches from a disk-tier
  buffer through a `jaxbuf.Prefetcher` (the wait per batch).
* `tiers`: the same two layouts at a size that fits in RAM, on each tier
  (device: NumPy-fed CPU arrays; host: pinned host memory; disk), S = 32
  stacks and S = 256 items: batches/s of each.

Usage:
  python benchmarks/bench_storage.py --directory /work/tmp-storage --frames-gib 32
  python benchmarks/bench_storage.py --quick      # tiny sizes, a smoke run
"""

import argparse
import functools
import json
import os
import shutil
import sys
import time

import pathlib

# The repository root (the folder holding jaxbuf/), wherever under
# benchmarks/ this script sits, so that it runs without an installed jaxbuf.
ROOT = next(
  parent
  for parent in pathlib.Path(__file__).resolve().parents
  if (parent / "jaxbuf" / "__init__.py").exists()
)
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxbuf  # noqa: E402

FRAME = (84, 84)
NUM_ENVS = 8
NUM_STACK = 4
STATE = 64
GIB = 2**30


def rss_anon_mib() -> float:
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def frame_step() -> dict:
  return {
    "obs": jnp.zeros(FRAME, jnp.uint8),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }


def state_item() -> dict:
  return {
    "obs": jnp.zeros(STATE, jnp.float32),
    "next_obs": jnp.zeros(STATE, jnp.float32),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
  }


def frame_chunks(chunk: int, rng: np.random.Generator):
  """An endless supply of [N, chunk] steps of random frames (one block of
  random bytes, shifted per call: the generation is not what is measured)."""
  block = rng.integers(0, 255, (NUM_ENVS, chunk + 64, *FRAME), dtype=np.uint8)
  call = 0
  while True:
    shift = call % 64
    call += 1
    yield {
      "obs": block[:, shift : shift + chunk],
      "action": np.full((NUM_ENVS, chunk), call, np.int32),
      "reward": np.ones((NUM_ENVS, chunk), np.float32),
      "terminated": (np.arange(chunk) % 500 == 499)[None, :].repeat(NUM_ENVS, 0),
    }


def item_chunks(chunk: int, rng: np.random.Generator):
  block = rng.normal(size=(chunk + 64, STATE)).astype(np.float32)
  call = 0
  while True:
    shift = call % 64
    call += 1
    yield {
      "obs": block[shift : shift + chunk],
      "next_obs": block[shift : shift + chunk] + 1,
      "action": np.full((chunk,), call, np.int32),
      "reward": np.ones((chunk,), np.float32),
    }


def fill(buffer, state, chunks, adds: int, *, rows_per_add: int, row_bytes: int) -> tuple:
  """Adds `adds` chunks; the state, rows/s, MB/s and the peak RssAnon."""
  peak = rss_anon_mib()
  start = time.perf_counter()
  for index in range(adds):
    state = buffer.add(state, next(chunks))
    if index % 16 == 0:
      peak = max(peak, rss_anon_mib())
  jax.block_until_ready(state)
  seconds = time.perf_counter() - start
  rows = adds * rows_per_add
  return state, rows / seconds, rows * row_bytes / seconds / 1e6, max(peak, rss_anon_mib())


def batches_per_second(buffer, state, batch_size: int, batches: int) -> float:
  keys = list(jax.random.split(jax.random.key(1), batches))
  jax.block_until_ready(buffer.sample(state, jax.random.key(0), batch_size))  # compiled
  start = time.perf_counter()
  for key in keys:
    jax.block_until_ready(buffer.sample(state, key, batch_size))
  return batches / (time.perf_counter() - start)


def drop_page_cache(storage) -> None:
  for fd in storage.files.fds.values():
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def learner_step(milliseconds: float):
  """A jitted step of about `milliseconds` on this machine: matmuls on the batch."""
  weights = jnp.ones((256, 256), jnp.float32) / 256

  @jax.jit
  def step(pixels, weights, repeats):
    x = pixels.reshape(pixels.shape[0], -1)[:, :256].astype(jnp.float32)
    return jax.lax.fori_loop(0, repeats, lambda _, x: jnp.tanh(x @ weights), x).sum()

  pixels = jnp.zeros((32, *FRAME, NUM_STACK), jnp.uint8)
  repeats = 1
  while True:
    jax.block_until_ready(step(pixels, weights, repeats))
    start = time.perf_counter()
    jax.block_until_ready(step(pixels, weights, repeats))
    took = (time.perf_counter() - start) * 1e3
    if took >= milliseconds or repeats > 2**16:
      return (lambda batch: step(batch, weights, repeats)), took
    repeats *= 2


def prefetch_waits(buffer, state, batches: int, step_ms: float) -> dict:
  """Per batch: the wait for the batch and the whole step, with and without
  a Prefetcher, around a jitted learner step of about `step_ms`."""
  learn, step_took = learner_step(step_ms)
  result = {"learner_step_ms": round(step_took, 2)}
  for enabled in (False, True):
    waits = []
    with jaxbuf.Prefetcher(buffer.sample, enabled=enabled) as prefetcher:
      prefetcher.submit(state, jax.random.key(0), 32)
      start = time.perf_counter()
      for step in range(batches):
        before = time.perf_counter()
        batch = prefetcher.result(timeout=600)
        waits.append(time.perf_counter() - before)
        prefetcher.submit(state, jax.random.key(step + 1), 32)
        jax.block_until_ready(learn(batch.items.obs))
      total = time.perf_counter() - start
      prefetcher.result(timeout=600)
    label = "prefetch" if enabled else "no_prefetch"
    result[f"{label}_wait_ms_median"] = round(float(np.median(waits)) * 1e3, 2)
    result[f"{label}_step_total_ms"] = round(total / batches * 1e3, 2)
  return result


def frames_disk(directory: str, gib: float, chunk: int, batches: int) -> dict:
  capacity = int(gib * GIB / np.prod(FRAME)) // (NUM_ENVS * chunk) * NUM_ENVS * chunk
  storage = jaxbuf.disk(os.path.join(directory, "frames"))
  buffer = jaxbuf.frame_stack_replay(NUM_ENVS, capacity, NUM_STACK, storage=storage)
  state = buffer.init(frame_step())
  chunks = frame_chunks(chunk, np.random.default_rng(0))
  adds = capacity // (NUM_ENVS * chunk)
  state, rows_per_second, megabytes, peak = fill(
    buffer, state, chunks, adds, rows_per_add=NUM_ENVS * chunk, row_bytes=int(np.prod(FRAME))
  )
  storage.sync()
  sampled = batches_per_second(buffer, state, 32, batches)
  result = dict(
    capacity_frames=capacity,
    payload_gib=round(capacity * np.prod(FRAME) / GIB, 2),
    fill_frames_per_s=round(rows_per_second),
    fill_mb_per_s=round(megabytes),
    sample_32x4_batches_per_s=round(sampled, 1),
    rss_anon_peak_mib=round(max(peak, rss_anon_mib())),
  )
  return result, buffer, state, storage


def items_disk(directory: str, gib: float, chunk: int, batches: int) -> tuple:
  row_bytes = 2 * STATE * 4
  capacity = int(gib * GIB / row_bytes) // chunk * chunk
  storage = jaxbuf.disk(os.path.join(directory, "items"))
  buffer = jaxbuf.uniform_replay(capacity, storage=storage)
  state = buffer.init(state_item())
  state, rows_per_second, megabytes, peak = fill(
    buffer,
    state,
    item_chunks(chunk, np.random.default_rng(1)),
    capacity // chunk,
    rows_per_add=chunk,
    row_bytes=row_bytes,
  )
  drop_page_cache(storage)
  sampled = batches_per_second(buffer, state, 256, batches)
  result = dict(
    capacity_items=capacity,
    payload_gib=round(capacity * row_bytes / GIB, 2),
    fill_items_per_s=round(rows_per_second),
    sample_256_batches_per_s=round(sampled, 1),
    rss_anon_peak_mib=round(max(peak, rss_anon_mib())),
  )
  return result, buffer, state, storage


def tiers_in_ram(directory: str, frames: int, items: int, batches: int) -> dict:
  results = {}
  for tier in ("device", "host", "disk"):
    for layout in ("frames", "items"):
      storage = jaxbuf.disk(os.path.join(directory, f"ram-{layout}")) if tier == "disk" else tier
      if layout == "frames":
        buffer = jaxbuf.frame_stack_replay(NUM_ENVS, frames, NUM_STACK, storage=storage)
        state = buffer.init(frame_step())
        chunks, size, rows = frame_chunks(256, np.random.default_rng(0)), 32, NUM_ENVS * 256
      else:
        buffer = jaxbuf.uniform_replay(items, storage=storage)
        state = buffer.init(state_item())
        chunks, size, rows = item_chunks(8192, np.random.default_rng(1)), 256, 8192
      capacity = frames if layout == "frames" else items
      for _ in range(max(1, capacity // rows)):
        state = buffer.add(state, next(chunks))
      results[f"{layout}_{tier}_batches_per_s"] = round(
        batches_per_second(buffer, state, size, batches), 1
      )
      if tier == "disk":
        storage.close()
      del state
  return results


def jitted_samples(buffer, state, batch_size: int, leaf, repeats: int) -> float:
  """Seconds per sample: `repeats` samples in one jitted loop (a sum of
  `leaf(items)` kept so that nothing is optimised away)."""

  @jax.jit
  def loop(state, key):
    def body(step, total):
      items = buffer.sample(state, jax.random.fold_in(key, step), batch_size).items
      return total + leaf(items).astype(jnp.float32).sum()

    return jax.lax.fori_loop(0, repeats, body, jnp.float32(0))

  jax.block_until_ready(loop(state, jax.random.key(0)))
  times = []
  for attempt in range(3):
    start = time.perf_counter()
    jax.block_until_ready(loop(state, jax.random.key(attempt + 1)))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) / repeats


def device_case(directory: str, item_capacities, frames: int, batches: int, chunk: int) -> dict:
  """Host tier against device tier (items), a host-tier frame buffer, and
  prefetched pixel batches from disk: the GPU part of the device suite."""
  result: dict = {}
  item = {"obs": jnp.zeros(16, jnp.float32), "action": jnp.int32(0), "reward": jnp.float32(0)}

  @functools.partial(jax.jit, static_argnums=1)
  def items_of(seed, rows):
    obs = jax.random.normal(jax.random.key(seed), (rows, 16))
    return {"obs": obs, "action": jnp.arange(rows, dtype=jnp.int32), "reward": obs[:, 0]}

  for capacity in item_capacities:
    seconds = {}
    for tier in ("device", "host"):
      buffer = jaxbuf.uniform_replay(capacity, storage=tier)
      state = buffer.init(item)
      rows = min(capacity, 1_000_000)
      for index in range(capacity // rows):
        state = buffer.add(state, items_of(index, rows))
      seconds[tier] = jitted_samples(buffer, state, 256, lambda items: items["obs"], 100)
      del state
    ratio = seconds["host"] / seconds["device"]
    result[f"items_{capacity}"] = dict(
      device_us=round(seconds["device"] * 1e6, 1),
      host_us=round(seconds["host"] * 1e6, 1),
      ratio=round(ratio, 2),
    )
    print(
      f"{'PASS' if ratio <= 2 else 'FAIL'}  host tier sample 256 at C={capacity}: "
      f"{ratio:.2f}x the device tier's ({json.dumps(result[f'items_{capacity}'])}), goal <= 2x"
    )

  @functools.partial(jax.jit, static_argnums=1)
  def frames_of(seed, length):
    pixels = jax.random.randint(jax.random.key(seed), (NUM_ENVS, length, *FRAME), 0, 255)
    return {
      "obs": pixels.astype(jnp.uint8),
      "action": jnp.zeros((NUM_ENVS, length), jnp.int32),
      "reward": jnp.ones((NUM_ENVS, length), jnp.float32),
      "terminated": jnp.zeros((NUM_ENVS, length), bool),
    }

  capacity = frames // (NUM_ENVS * chunk) * NUM_ENVS * chunk
  buffer = jaxbuf.frame_stack_replay(NUM_ENVS, capacity, NUM_STACK, storage="host")
  state = buffer.init(frame_step())
  start = time.perf_counter()
  for index in range(capacity // (NUM_ENVS * chunk)):
    state = buffer.add(state, frames_of(index, chunk))
  jax.block_until_ready(state)
  fill_seconds = time.perf_counter() - start
  per_sample = jitted_samples(buffer, state, 32, lambda items: items.obs, 20)
  result["frames_host"] = dict(
    capacity_frames=capacity,
    payload_gb=round(capacity * np.prod(FRAME) / 1e9, 1),
    fill_frames_per_s=round(capacity / fill_seconds),
    sample_32x4_batches_per_s=round(1 / per_sample, 1),
  )
  print(f"info  host-tier frames: {json.dumps(result['frames_host'])}")
  del state, buffer

  disk_frames = min(frames, 1_000_000)
  disk_result, disk_buffer, disk_state, storage = frames_disk(
    directory, disk_frames * np.prod(FRAME) / GIB, chunk, batches
  )
  result["frames_disk"] = disk_result
  result["prefetch"] = prefetch_waits(disk_buffer, disk_state, batches, 3.0)
  print(f"info  disk-tier frames with prefetch: {json.dumps(result['prefetch'])}")
  storage.close()
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--directory", default="/work/tmp-storage")
  parser.add_argument("--cases", nargs="+", default=["frames", "items", "prefetch", "tiers"])
  parser.add_argument("--frames-gib", type=float, default=32.0)
  parser.add_argument("--items-gib", type=float, default=8.0)
  parser.add_argument("--chunk", type=int, default=512)
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--ram-frames", type=int, default=200_000)
  parser.add_argument("--ram-items", type=int, default=1_000_000)
  parser.add_argument("--device-items", type=int, nargs="+", default=[1_000_000, 100_000_000])
  parser.add_argument("--device-frames", type=int, default=10_000_000)
  parser.add_argument("--keep", action="store_true", help="keep the payload files")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
  args = parser.parse_args(argv)
  if args.quick:
    args.frames_gib, args.items_gib, args.chunk, args.batches = 0.01, 0.01, 64, 5
    args.ram_frames, args.ram_items = 4096, 8192
    args.device_items, args.device_frames = [4096], 4096
  os.makedirs(args.directory, exist_ok=True)
  report = dict(
    jax=jax.__version__,
    numpy=np.__version__,
    backend=jax.default_backend(),
    load_average=os.getloadavg(),
    arguments=vars(args),
  )
  print(f"info  jax {jax.__version__} on {jax.default_backend()}, load {os.getloadavg()}")
  try:
    if "frames" in args.cases:
      result, buffer, state, storage = frames_disk(
        args.directory, args.frames_gib, args.chunk, args.batches
      )
      report["frames_disk"] = result
      print(f"info  frames on disk: {json.dumps(result)}")
      limit = 4 * 1024
      verdict = "PASS" if result["rss_anon_peak_mib"] < limit else "FAIL"
      print(f"{verdict}  RssAnon peak {result['rss_anon_peak_mib']} MiB < {limit} MiB")
      if "prefetch" in args.cases:
        report["prefetch"] = prefetch_waits(buffer, state, args.batches, 3.0)
        print(f"info  prefetch (frames, disk): {json.dumps(report['prefetch'])}")
      storage.close()
      del buffer, state
    if "items" in args.cases:
      result, buffer, state, storage = items_disk(
        args.directory, args.items_gib, 8 * args.chunk * 16, args.batches
      )
      report["items_disk"] = result
      print(f"info  items on disk: {json.dumps(result)}")
      storage.close()
      del buffer, state
    if "device" in args.cases:
      report["device"] = device_case(
        args.directory, args.device_items, args.device_frames, args.batches, args.chunk
      )
    if "tiers" in args.cases:
      report["tiers"] = tiers_in_ram(args.directory, args.ram_frames, args.ram_items, args.batches)
      print(f"info  tiers in RAM: {json.dumps(report['tiers'])}")
    report["load_average_end"] = os.getloadavg()
    print("RESULT " + json.dumps(report))
  finally:
    if not args.keep:
      shutil.rmtree(args.directory, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
