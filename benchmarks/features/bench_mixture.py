"""jaxbuf.mixture in a fused loop against the sum of its parts' own samples.

Shape key: S sample size (256), C capacity of each part, K iterations.

The RLPD layout: offline data in a uniform item replay of C transitions and
online experience in a prioritized one of C, mixed 50/50. One iteration
draws a batch of S inside one jitted, donated `lax.scan` of K iterations:

* "mixture": `mixture.sample(states, key, S)`, the S rows concatenated;
* "parts": the same work by hand, `uniform.sample(.., S_0)` and
  `prioritized.sample(.., S_1)` with S_0 + S_1 = S (`mixture.rows(S)`), each
  part's own sample and nothing else: what the mixture is judged against;
* "uniform alone", "prioritized alone": each part's S_k rows alone (info).

With `--update` (on by default) each iteration also sets the sampled rows'
priorities (the mixture's `update_priorities`, the prioritized buffer's own
for "parts"). Every key is split before the scan, each part's key too for
"parts", so the mixture's own key handling (one fold-in per part) is timed
as its overhead. The carry sums everything sampled, so no gather is dead
code. The loops are interleaved (`harness.time_fused_loops`), medians of
the repeats, time per iteration.

The item is a continuous-control transition of HalfCheetah's sizes
(obs and next_obs float32 [17], action [6], reward, discount): 168 bytes.

Usage:
  taskset -c 0 .venv/bin/python benchmarks/features/bench_mixture.py          # ~1 min CPU
  .venv/bin/python benchmarks/features/bench_mixture.py --quick               # seconds
"""

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf

MIXTURE_OVER_PARTS = 1.1  # mixture time / the sum of its parts', at most
OBS_SIZE, ACTION_SIZE = 17, 6
SAMPLE_BATCH = 256
PROPORTIONS = (0.5, 0.5)


@dataclasses.dataclass
class Settings:
  capacities: tuple[int, ...]
  iterations: int  # K, per timed fused call
  repeats: int
  update: bool = True


FULL = Settings(capacities=(1_000_000,), iterations=300, repeats=7)
QUICK = Settings(capacities=(2_000,), iterations=10, repeats=2)


def example_transition() -> dict:
  return {
    "obs": jnp.zeros(OBS_SIZE),
    "action": jnp.zeros(ACTION_SIZE),
    "reward": jnp.zeros(()),
    "discount": jnp.zeros(()),
    "next_obs": jnp.zeros(OBS_SIZE),
  }


def transitions(key: jax.Array, count: int) -> dict:
  return jax.tree.map(
    lambda leaf: jax.random.normal(key, (count, *leaf.shape)), example_transition()
  )


def checksum(items: dict, weights: jax.Array) -> jax.Array:
  return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(items)) + jnp.sum(weights)


def td_errors(items: dict) -> jax.Array:
  """Stand-in priorities computed from the sampled rows, as a learner's."""
  return jnp.abs(items["reward"]) + 0.01


def make_loop(body, iterations: int, num_keys: int):
  """`(state, key) -> (state, checksum)`: K iterations of `body(state,
  keys [num_keys], acc)` in one donated jit, every key split before."""

  def loop(state, key):
    keys = jax.random.split(key, (iterations, num_keys))

    def iteration(carry, step_keys):
      state, acc = carry
      return body(state, step_keys, acc), None

    (state, acc), _ = jax.lax.scan(iteration, (state, jnp.zeros((), jnp.float32)), keys)
    return state, acc

  return jax.jit(loop, donate_argnums=0)


def make_loops(capacity: int, settings: Settings):
  offline = jaxbuf.uniform_replay(capacity)
  online = jaxbuf.prioritized_replay(capacity)
  mixture = jaxbuf.mixture([offline, online], list(PROPORTIONS))
  offline_rows, online_rows = mixture.rows(SAMPLE_BATCH)
  update = settings.update

  def mixed(states, keys, acc):
    batch = mixture.sample(states, keys[0], SAMPLE_BATCH)
    if update:
      states = mixture.update_priorities(states, batch, td_errors(batch.items))
    return states, acc + checksum(batch.items, batch.weights)

  def offline_part(state, key, acc):
    batch = offline.sample(state, key, offline_rows)
    return state, acc + checksum(batch.items, batch.weights)

  def online_part(state, key, acc):
    batch = online.sample(state, key, online_rows)
    if update:
      state = online.update_priorities(state, batch.indices, td_errors(batch.items), batch.item_ids)
    return state, acc + checksum(batch.items, batch.weights)

  def parts(states, keys, acc):
    offline_state, acc = offline_part(states[0], keys[0], acc)
    online_state, acc = online_part(states[1], keys[1], acc)
    return [offline_state, online_state], acc

  loops = {
    "mixture": make_loop(mixed, settings.iterations, 1),
    "parts": make_loop(parts, settings.iterations, 2),
    "uniform alone": make_loop(
      lambda s, k, acc: offline_part(s, k[0], acc), settings.iterations, 1
    ),
    "prioritized alone": make_loop(
      lambda s, k, acc: online_part(s, k[0], acc), settings.iterations, 1
    ),
  }

  def filled(buffer, seed):
    state = buffer.init(example_transition())
    return buffer.add(state, transitions(jax.random.key(seed), capacity))

  states = {
    "mixture": [filled(offline, 0), filled(online, 1)],
    "parts": [filled(offline, 0), filled(online, 1)],
    "uniform alone": filled(offline, 0),
    "prioritized alone": filled(online, 1),
  }
  return loops, states, (offline_rows, online_rows)


def run_benchmark(settings: Settings) -> dict:
  results = dict(machine=harness.print_machine(), rows=[])
  for capacity in settings.capacities:
    print(f"C={capacity}: filling", flush=True)
    loops, states, rows = make_loops(capacity, settings)
    print(f"C={capacity}: fused, rows per part {rows}", flush=True)
    seconds = harness.time_fused_loops(
      loops, states, iterations=settings.iterations, repeats=settings.repeats
    )
    results["rows"].append(
      dict(capacity=capacity, rows=rows, update=settings.update, seconds=seconds)
    )
    del loops, states
  results["load_average_after"] = harness.print_load_average_after()
  results["verdicts"] = report(results)
  return results


COLUMNS = (
  ("C", 10),
  ("rows", -10),
  ("mixture us", 11),
  ("parts us", 9),
  ("uniform us", 11),
  ("prioritized us", 15),
  ("mix/parts", 10),
)


def report(results: dict) -> list[str]:
  print(
    f"\nS={SAMPLE_BATCH}, proportions {PROPORTIONS}, per iteration of a "
    f"fused scan (sample"
    f"{' + update_priorities' if results['rows'][0]['update'] else ''})"
  )
  table = []
  verdicts = harness.Verdicts()
  for row in results["rows"]:
    seconds = row["seconds"]
    overhead = harness.ratio(seconds["mixture"], seconds["parts"])
    table.append(
      (
        row["capacity"],
        "/".join(map(str, row["rows"])),
        harness.microseconds(seconds["mixture"]),
        harness.microseconds(seconds["parts"]),
        harness.microseconds(seconds["uniform alone"]),
        harness.microseconds(seconds["prioritized alone"]),
        harness.ratio_text(overhead),
      )
    )
    verdicts.judge(
      f"mixture / sum of its parts' samples, C={row['capacity']} each",
      overhead,
      MIXTURE_OVER_PARTS,
      higher_is_better=False,
    )
    verdicts.info(
      f"C={row['capacity']}: mixture {harness.microseconds(seconds['mixture'])}"
      f" us, parts {harness.microseconds(seconds['parts'])} us (uniform "
      f"alone {harness.microseconds(seconds['uniform alone'])} us + "
      f"prioritized alone "
      f"{harness.microseconds(seconds['prioritized alone'])} us) per "
      f"iteration"
    )
  harness.print_table(COLUMNS, table)
  verdicts.print("Targets (mixture time / parts' time, lower is better):")
  return verdicts.lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few repeats: a smoke test"
  )
  parser.add_argument("--capacities", type=int, nargs="+", help="capacity of each part")
  parser.add_argument(
    "--no-update", dest="update", action="store_false", help="sample only, no priority updates"
  )
  parser.add_argument("--json", help="write the results to this file")
  args = parser.parse_args()
  settings = harness.override(QUICK if args.quick else FULL, args, ("capacities",))
  settings = dataclasses.replace(settings, update=args.update)
  harness.write_json(args.json, run_benchmark(settings))


if __name__ == "__main__":
  main()
