"""Bytes a sharded replay buffer moves between devices, read from the HLO.

For each device count D (fake CPU devices), buffer kind (uniform,
prioritized), sampling mode (global, local) and batch layout (sharded,
replicated), one `sample` of S = 256 items with an 84-float32 observation
(plus an int32 action; 340 bytes a row) and one `update_priorities` of
that sample are compiled, and every collective in the compiled HLO is read:

* operand bytes: the sum of the collectives' operand sizes (a
  reduce-scatter's operand is the whole `[S, ...]` batch), derived from
  their result shapes, since compiled HLO prints operands without shapes;
* moved per device: what each device sends under the standard ring
  algorithms, `2 (D - 1) / D` of an all-reduce's operand and `(D - 1) / D`
  of a reduce-scatter's, an all-gather's result or an all-to-all's operand.

The goal is at most the batch's own bytes (S rows) moved per device; a
replicated psum of the whole batch costs about twice that, the ideal
exchange of only the rows each device receives about 1 / D of it.

Sequence replay (sharded over envs) is measured the same way for S = 64
windows of L = 40 steps with an 84-float32 observation (336 bytes a step,
plus the 1-byte first-episode mask that comes back with each step), 16 envs
of 1024 steps, across episodes, uniform and prioritized; `add` of one step
per env is read too.

Per-step times on fake CPU devices are not given: the D "devices" share one
process and the host's cores, so a time per step says nothing of how the
sampling scales across real devices. What is timed (`--cases overhead`) is
the sharded path's cost on one real device: `sharded(buffer, mesh of 1
device)` against the plain buffer, a fused loop of K = 100 iterations (add
256 items, sample 256, update their priorities) in one donated jit, median
of interleaved repeats; the goal is at most 1.1x.

Run: python benchmarks/features/bench_sharded.py [--devices 2 4 8]
                                         [--cases items sequences overhead]
"""

import argparse
import os
import pathlib
import re
import sys

# Before JAX initialises its backends: enough fake devices for the largest D.
if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
import jaxbuf  # noqa: E402
from benchmarks.common import harness

BATCH = 256
OBS = 84
CAPACITY = 2**14
WINDOWS = 64
SEQUENCE_LENGTH = 40
NUM_ENVS = 16
COLLECTIVES = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
  "ragged-all-to-all",
)
# `%name = <result shape> <op>(<operands>)`; async pairs appear as -start.
_INSTRUCTION = re.compile(
  r"=\s*(?P<result>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\((?P<operands>[^)]*)\)"
)
_SHAPE = re.compile(
  r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)"
  r"\[([0-9,]*)\]"
)
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}


def shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * _BYTES[dtype]
  return total


def collective_bytes(hlo: str, num_devices: int) -> tuple[dict[str, int], int, float]:
  """Collective op counts, their operand bytes, and bytes moved per device."""
  counts, operand_total, moved = {}, 0, 0.0
  share = (num_devices - 1) / num_devices
  for match in _INSTRUCTION.finditer(hlo):
    op = match["op"]
    # Compiled HLO names operands without their shapes; the result's shape
    # gives the operand's: equal, or 1/D of it for a reduce-scatter, D times
    # it for an all-gather.
    result = shape_bytes(match["result"])
    operand = {"reduce-scatter": result * num_devices, "all-gather": result // num_devices}.get(
      op, result
    )
    counts[op] = counts.get(op, 0) + 1
    operand_total += operand
    moved += {
      "all-reduce": 2 * share * operand,
      "reduce-scatter": share * operand,
      "all-gather": share * result,
      "all-to-all": share * operand,
      "ragged-all-to-all": share * operand,
      "collective-permute": operand,
    }[op]
  return counts, operand_total, moved


def _sharded_spec(tree, mesh):
  """A sharded state's shapes, laid out over the mesh axis as `init` does."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape,
      x.dtype,
      sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    ),
    tree,
  )


def measure(num_devices: int, kind: str, sampling: str, batch: str):
  mesh = jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])
  inner = (
    jaxbuf.uniform_replay(CAPACITY) if kind == "uniform" else jaxbuf.prioritized_replay(CAPACITY)
  )
  buffer = jaxbuf.sharded(inner, mesh, sampling=sampling, batch=batch)
  item = {"obs": jnp.zeros(OBS, jnp.float32), "action": jnp.int32(0)}
  state = _sharded_spec(jax.eval_shape(buffer.init, item), mesh)
  key = jax.random.key(0)
  sample_hlo = (
    jax.jit(lambda s, k: buffer.sample(s, k, BATCH)).lower(state, key).compile().as_text()
  )
  sample = jax.eval_shape(lambda s, k: buffer.sample(s, k, BATCH), state, key)
  update_hlo = (
    jax.jit(buffer.update_priorities)
    .lower(state, sample.indices, sample.weights, sample.item_ids)
    .compile()
    .as_text()
  )
  add_hlo = (
    jax.jit(buffer.add)
    .lower(state, {"obs": jnp.zeros((BATCH, OBS)), "action": jnp.zeros(BATCH, jnp.int32)})
    .compile()
    .as_text()
  )
  return (
    collective_bytes(sample_hlo, num_devices),
    collective_bytes(update_hlo, num_devices),
    collective_bytes(add_hlo, num_devices),
  )


def measure_sequence(num_devices: int, kind: str, sampling: str, batch: str):
  """As `measure`, for sequence replay: S = 64 windows of L = 40 steps."""
  mesh = jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])
  make = jaxbuf.sequence_replay if kind == "uniform" else jaxbuf.prioritized_sequence_replay
  inner = make(NUM_ENVS, NUM_ENVS * 1024, SEQUENCE_LENGTH)
  buffer = jaxbuf.sharded(inner, mesh, sampling=sampling, batch=batch)
  step = {"obs": jnp.zeros(OBS, jnp.float32)}
  state = _sharded_spec(jax.eval_shape(buffer.init, step), mesh)
  key = jax.random.key(0)
  draw = lambda s, k: buffer.sample(s, k, WINDOWS)
  sample_hlo = jax.jit(draw).lower(state, key).compile().as_text()
  sample = jax.eval_shape(draw, state, key)
  update_hlo = (
    jax.jit(buffer.update_priorities)
    .lower(state, sample.indices, sample.weights, sample.item_ids)
    .compile()
    .as_text()
  )
  add_hlo = (
    jax.jit(buffer.add).lower(state, {"obs": jnp.zeros((NUM_ENVS, OBS))}).compile().as_text()
  )
  return (
    collective_bytes(sample_hlo, num_devices),
    collective_bytes(update_hlo, num_devices),
    collective_bytes(add_hlo, num_devices),
  )


OVERHEAD_ITERATIONS = 100
OVERHEAD_CAPACITY = 2**17


def single_device_overhead(
  kind: str, capacity: int = OVERHEAD_CAPACITY, repeats: int = 7
) -> dict[str, float]:
  """Seconds per fused iteration, plain buffer and sharded over 1 device."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  plain = (
    jaxbuf.uniform_replay(capacity) if kind == "uniform" else jaxbuf.prioritized_replay(capacity)
  )
  buffers = {"plain": plain, "sharded": jaxbuf.sharded(plain, mesh)}
  rows = {
    "obs": jax.random.normal(jax.random.key(1), (BATCH, OBS)),
    "action": jnp.zeros(BATCH, jnp.int32),
  }

  def loop_for(buffer):
    def iteration(state, key):
      state = buffer.add(state, rows)
      batch = buffer.sample(state, key, BATCH)
      state = buffer.update_priorities(
        state, batch.indices, jnp.abs(batch.items["obs"][:, 0]) + 0.01, batch.item_ids
      )
      return state, jnp.sum(batch.items["obs"]) + jnp.sum(batch.weights)

    return jax.jit(
      lambda state, key: jax.lax.scan(iteration, state, jax.random.split(key, OVERHEAD_ITERATIONS)),
      donate_argnums=0,
    )

  calls = {}
  for name, buffer in buffers.items():
    state = buffer.init({"obs": jnp.zeros(OBS, jnp.float32), "action": jnp.int32(0)})
    fill = min(2**14, capacity)
    for start in range(0, capacity, fill):  # full, wrapped
      state = buffer.add(
        state,
        {"obs": jnp.full((fill, OBS), start, jnp.float32), "action": jnp.zeros(fill, jnp.int32)},
      )
    calls[name] = harness.carrying(
      lambda state, loop=loop_for(buffer): loop(state, jax.random.key(0)),  # noqa: B008
      state,
    )
  seconds = harness.time_interleaved(calls, repeats=repeats, warmup=2)
  return {name: value / OVERHEAD_ITERATIONS for name, value in seconds.items()}


def report_overhead(verdicts, quick: bool = False) -> None:
  capacity = 2 * BATCH if quick else OVERHEAD_CAPACITY
  print(
    f"\noverhead on one device: capacity {capacity}, add + sample "
    f"+ update of {BATCH} items per iteration, us per iteration\n"
  )
  for kind in ("uniform", "prioritized"):
    seconds = single_device_overhead(kind, capacity, repeats=1 if quick else 7)
    ratio = seconds["sharded"] / seconds["plain"]
    print(
      f"  {kind:12s} plain {seconds['plain'] * 1e6:8.1f}  sharded (D=1) "
      f"{seconds['sharded'] * 1e6:8.1f}  {ratio:.2f}x"
    )
    verdicts.judge(
      f"{kind} sharded over 1 device / plain buffer, {jax.default_backend()}",
      ratio,
      1.1,
      higher_is_better=False,
    )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument(
    "--cases", nargs="+", default=["items", "sequences"], choices=["items", "sequences", "overhead"]
  )
  parser.add_argument(
    "--quick", action="store_true", help="overhead at a tiny capacity, one repeat: a smoke run"
  )
  args = parser.parse_args()
  harness.print_machine()
  verdicts = harness.Verdicts()
  if "overhead" in args.cases:
    report_overhead(verdicts, args.quick)
  cases = []
  if "items" in args.cases:
    row_bytes = OBS * 4 + 4
    cases.append(
      (
        "items",
        measure,
        BATCH * row_bytes,
        f"S = {BATCH}, a row {row_bytes} bytes: the batch is "
        f"{BATCH * row_bytes} bytes; capacity {CAPACITY}.",
      )
    )
  if "sequences" in args.cases:
    window_bytes = SEQUENCE_LENGTH * (OBS * 4 + 1)
    cases.append(
      (
        "sequences",
        measure_sequence,
        WINDOWS * window_bytes,
        f"S = {WINDOWS} windows of L = {SEQUENCE_LENGTH} steps, a "
        f"window {window_bytes} bytes (mask included): the batch "
        f"is {WINDOWS * window_bytes} bytes; {NUM_ENVS} envs of "
        "1024 steps.",
      )
    )
  for case, measure_case, batch_bytes, title in cases:
    print(f"\n{case}: {title}\n")
    rows = []
    for num_devices in args.devices:
      for kind in ("uniform", "prioritized"):
        for sampling in ("global", "local"):
          for batch in ("sharded", "replicated"):
            ((ops, operand, moved), (_, _, update_moved), (add_ops, _, _)) = measure_case(
              num_devices, kind, sampling, batch
            )
            rows.append(
              (
                num_devices,
                kind,
                sampling,
                batch,
                " ".join(f"{op}x{n}" for op, n in sorted(ops.items())) or "none",
                operand,
                round(moved),
                f"{moved / batch_bytes:.2f}",
                round(update_moved),
                "none" if not add_ops else str(add_ops),
              )
            )
            if sampling == "global" and batch == "sharded":
              verdicts.judge(
                f"{case} D={num_devices} {kind} global sharded: moved per device / batch bytes",
                moved / batch_bytes,
                1.0,
                higher_is_better=False,
              )
    harness.print_table(
      [
        ("D", 2),
        ("kind", -11),
        ("sampling", -8),
        ("batch", -10),
        ("sample collectives", -30),
        ("operand B", 10),
        ("moved/dev B", 11),
        ("/batch", 6),
        ("update moved/dev B", 18),
        ("add collectives", -15),
      ],
      rows,
    )
  verdicts.info("per-step times on fake CPU devices are not a scaling figure and are not reported")
  verdicts.print("Verdicts")


if __name__ == "__main__":
  main()
