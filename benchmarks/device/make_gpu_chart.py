"""Draws docs/_static/gpu_h100.png from the device suite's JSON output.

    python benchmarks/device/make_gpu_chart.py \
      [benchmarks/results/device_suite_h100_2026-11-26.json]

The figures are read from the JSON that `benchmarks/device/device_suite.py --out`
wrote (its parts' verdict lines), never typed in: rerun the suite, then this
script, and commit the PNG. The title states the machine and versions.
"""

import json
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "benchmarks" / "results" / "device_suite_h100_2026-11-26.json"
OUT = ROOT / "docs" / "_static" / "gpu_h100.png"

ITEM = re.compile(
  r"info  (uniform|prioritized) fused, C=(\d+): jaxbuf ([\d.]+) us, "
  r"flashbax ([\d.]+) us per iteration"
)
SEQUENCE = re.compile(
  r"info  (uniform|prioritized) fused, period \d+, C=[\d,]+: "
  r"jaxbuf ([\d.]+) us, flashbax ([\d.]+) us"
)
RATIO = re.compile(
  r"\w+\s+(uniform|prioritized) fused, (?:period \d+, )?C=([\d,]+), "
  r"flashbax/jaxbuf: ([\d.]+)x"
)
LOOP = re.compile(
  r"info  (DQN prioritized|DQN uniform|PPO), fused, (\d+) envs: "
  r"([\d,]+) env steps/s"
)


def verdicts(suite: dict, part: str) -> list[str]:
  for entry in suite["parts"]:
    if entry["name"] == part and entry["status"] == "ok":
      return entry["verdicts"]
  raise SystemExit(f"the suite has no successful part {part!r}")


def ratios(lines: list[str]) -> dict[tuple[str, int], str]:
  """The scripts' own flashbax/jaxbuf ratios (from unrounded times)."""
  found = {}
  for line in lines:
    match = RATIO.match(line)
    if match:
      kind, capacity, ratio = match.groups()
      found[kind, int(capacity.replace(",", ""))] = ratio
  return found


def fused_times(suite: dict) -> list[tuple[str, float, float, str]]:
  """(label, jaxbuf us, flashbax us, flashbax/jaxbuf) per fused iteration."""
  rows = []
  lines = verdicts(suite, "replay_fused")
  by_kind = ratios(lines)
  for line in lines:
    match = ITEM.match(line)
    if match:
      kind, capacity, ours, theirs = match.groups()
      rows.append(
        (
          f"{kind}\nitems, {int(capacity) // 10**6}M",
          float(ours),
          float(theirs),
          by_kind[kind, int(capacity)],
        )
      )
  lines = verdicts(suite, "sequence")
  by_kind = {kind: ratio for (kind, _), ratio in ratios(lines).items()}
  for line in lines:
    match = SEQUENCE.match(line)
    if match:
      kind, ours, theirs = match.groups()
      rows.append((f"{kind}\nwindows, 1M", float(ours), float(theirs), by_kind[kind]))
  return rows


def loop_rates(suite: dict) -> dict[str, dict[int, float]]:
  rates = {}
  for line in verdicts(suite, "loops"):
    match = LOOP.match(line)
    if match:
      name, envs, rate = match.groups()
      rates.setdefault(name, {})[int(envs)] = float(rate.replace(",", ""))
  return rates


def main(path: pathlib.Path) -> None:
  suite = json.loads(path.read_text())
  device = suite["device"]
  rows = fused_times(suite)
  rates = loop_rates(suite)
  if not rows or not rates:
    raise SystemExit(f"no figures found in {path}")

  figure, (left, right) = plt.subplots(
    1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]}
  )
  positions = range(len(rows))
  width = 0.38
  left.bar(
    [p - width / 2 for p in positions], [r[1] for r in rows], width, label="jaxbuf", color="#1f77b4"
  )
  left.bar(
    [p + width / 2 for p in positions],
    [r[2] for r in rows],
    width,
    label="flashbax 0.1.3",
    color="#ff7f0e",
  )
  for p, (_, ours, theirs, ratio) in zip(positions, rows):
    left.annotate(f"{ratio}x", (p, max(ours, theirs)), ha="center", va="bottom", fontsize=8)
  left.set_yscale("log")
  left.set_xticks(list(positions), [r[0] for r in rows], fontsize=8)
  left.set_ylabel("us per fused iteration (log scale; lower is faster)")
  left.set_title(
    "add 128 + sample 256 (+ priority update), in one jitted scan\n"
    "windows: add 128 envs + sample 64 windows of 40; "
    "labels: flashbax time / jaxbuf time",
    fontsize=9,
  )
  left.legend(fontsize=8)

  envs = sorted({n for by_envs in rates.values() for n in by_envs})
  names = sorted(rates)
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(envs))]
    right.bar(xs, [rates[name].get(n, 0) / 1e6 for n in envs], width, label=name)
  right.set_xticks(range(len(envs)), [f"{n} envs" for n in envs])
  right.set_ylabel("million env steps/s")
  right.set_title(
    "whole training loops fused (gymnax CartPole,\nenv + buffer + loss + optimizer in one program)",
    fontsize=9,
  )
  right.legend(fontsize=8)

  figure.suptitle(
    f"{device['gpu']}, jax {device['jax']}, CUDA {device['cuda']}; "
    f"benchmarks/device/device_suite.py ({path.name})",
    fontsize=10,
  )
  figure.tight_layout()
  OUT.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(OUT, dpi=110)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
