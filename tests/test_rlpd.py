"""examples/rlpd.py: a smoke run at tiny sizes, and the learning bar (slow).

The bar: over 3 seeds, TD3 drawing half of every batch from a medium
Pendulum dataset (jaxbuf.mixture) reaches the final return of TD3 from
scratch (online only, the same budget and hyperparameters) in at most half
the env steps. Run it with `pytest -m slow tests/test_rlpd.py`.
"""

import numpy as np
import pytest

pytest.importorskip("minari")
from examples import rlpd  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.filterwarnings("ignore::UserWarning:minari")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_rlpd_runs_end_to_end(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
  plot = tmp_path / "curves.png"
  results = rlpd.main(
    [
      "--dataset-steps",
      "400",
      "--total-steps",
      "400",
      "--learning-starts",
      "100",
      "--num-seeds",
      "2",
      "--hidden-size",
      "8",
      "--batch-size",
      "8",
      "--num-chunks",
      "2",
      "--curve-points",
      "2",
      "--plot",
      str(plot),
    ]
  )
  assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0] == (
    f"dataset: 2 episodes, 400 steps, mean return {results['dataset_mean_return']:.1f}"
  )
  assert lines[-1].startswith("mixing reaches online-only's final return")
  for name in ("mixing", "online only"):
    assert results[name]["final_returns"].shape == (2,)
    assert results[name]["curve"].shape == (2,)
    np.testing.assert_array_equal(results[name]["curve_steps"], [200, 400])
    assert np.all(np.isfinite(results[name]["curve"]))
  # A medium policy: better than random torques (about -1200), worse than
  # the scripted swing-up alone (about -140).
  assert -1100 < results["dataset_mean_return"] < -200


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning:minari")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_mixing_reaches_online_onlys_final_return_in_half_the_steps(tmp_path):
  results = rlpd.run(rlpd.Config(), str(tmp_path), show_progress=False)
  print(
    f"RLPD: dataset mean {results['dataset_mean_return']:.1f}; mixing "
    f"curve {np.round(results['mixing']['curve'])}; online only curve "
    f"{np.round(results['online only']['curve'])}; mixing reaches "
    f"online-only's final {results['online only']['final_mean_return']:.1f}"
    f" at {results['steps_to_online_final']} env steps"
  )
  assert results["bar_met"], results
