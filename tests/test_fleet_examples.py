"""The envpool modes of the host-loop examples (issue 51) at tiny sizes:
examples/gymnasium_dqn.py's recipe and examples/sebulba_dqn.py's actor
threads on envpool's CartPole (gymnasium's NEXT_STEP autoreset). envpool
is in the test extra: these run, never skipped."""

from examples import gymnasium_dqn
from examples import sebulba_dqn

TINY = dict(
  total_steps=400,
  num_envs=4,
  buffer_size=256,
  batch_size=8,
  learning_starts=64,
  hidden_size=16,
  target_update_interval=8,
  envpool=True,
)


def test_the_recipe_runs_on_envpool():
  result = gymnasium_dqn.train(gymnasium_dqn.Config(progress=False, **TINY))
  assert result["env_steps"] == 400
  assert result["episode_returns"].ended  # episodes ended and were tallied


def test_the_sebulba_example_runs_on_envpool():
  config = sebulba_dqn.Config(num_actors=2, error_buffer=64.0, **TINY)
  result = sebulba_dqn.train(config)
  assert result["env_steps"] >= 400
  assert abs(result["samples_per_insert"] - result["target_samples_per_insert"]) < 0.5
