"""Draws docs/_static/storage_tiers.png from `bench_storage.py`'s JSON output.

    python benchmarks/features/make_storage_chart.py \
      [benchmarks/results/storage_cpu_2026-11-28.json]

The figures are read from the JSON (the `RESULT` line `bench_storage.py`
printed), never typed in: rerun the benchmark, then this script, and commit
the PNG. The title states the machine, versions and load.
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "benchmarks" / "results" / "storage_cpu_2026-11-28.json"
OUT = ROOT / "docs" / "_static" / "storage_tiers.png"


def main(path: pathlib.Path) -> None:
  report = json.loads(path.read_text())
  tiers = report["tiers"]
  arguments = report["arguments"]
  layouts = (
    ("frames", f"32 stacks of 4 84x84 frames\n({arguments['ram_frames']:,} frames held)"),
    ("items", f"256 state items\n({arguments['ram_items']:,} items held)"),
  )
  figure, axes = plt.subplots(1, 3, figsize=(13, 4.2))
  colours = {"device": "#4c72b0", "host": "#55a868", "disk": "#c44e52"}
  for axis, (layout, title) in zip(axes[:2], layouts):
    names = ("device", "host", "disk")
    values = [tiers[f"{layout}_{name}_batches_per_s"] for name in names]
    bars = axis.bar(names, values, color=[colours[name] for name in names])
    axis.bar_label(bars, labels=[f"{value:,.0f}" for value in values])
    axis.set_title(f"in RAM: {title}", fontsize=10)
    axis.set_ylabel("batches / s")
  big = report["frames_disk"]
  items = report.get("items_disk", {})
  labels = ["frames, disk\n32 x 4 stacks"]
  values = [big["sample_32x4_batches_per_s"]]
  if items:
    labels.append("items, disk\n256 items")
    values.append(items["sample_256_batches_per_s"])
  bars = axes[2].bar(labels, values, color=colours["disk"])
  axes[2].bar_label(bars, labels=[f"{value:,.1f}" for value in values])
  axes[2].set_ylabel("batches / s")
  axes[2].set_title(
    f"on disk: {big['payload_gib']:.0f} GiB of frames (more than the RAM)"
    + (f",\n{items['payload_gib']:.0f} GiB of items" if items else "")
    + f"; RssAnon peak {big['rss_anon_peak_mib']:,} MiB",
    fontsize=10,
  )
  load = report["load_average"][0]
  figure.suptitle(
    f"jaxbuf storage tiers, CPU (2 cores, 24 GiB, shared; load {load:.0f}), jax {report['jax']}",
    fontsize=11,
  )
  figure.tight_layout()
  figure.savefig(OUT, dpi=110)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
