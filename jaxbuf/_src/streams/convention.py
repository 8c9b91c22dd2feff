"""The stream convention: how an env's experience is stored as one stream of
steps, for every kind that stores streams (`sequence_replay`,
`prioritized_sequence_replay`, `hindsight_replay`, `episode_replay`,
`frame_stack_replay`, `prioritized_frame_stack_replay`) and the functions
that read them (`n_step_transitions`, `n_step_targets`, `from_minari`).
This is its one home; `help(jaxbuf.streams)` shows it, and each of those
functions points here.

Shape key: N envs, T steps per env in one add.

Steps. A stream is the dm_env / RLDS sequence of an env's steps, so each
observation is stored once and a transition's next observation is read
from the stream, k steps later:

* step i holds `obs[i]`, the action taken there `action[i]`, the reward that
  followed `reward[i]`, and `terminated[i]`: that action truly ended the
  episode (no bootstrap from what follows);
* when an episode ends, terminated or truncated by a time limit, the stream
  gets one extra step holding the final observation, flagged `last`; its
  action, reward and `terminated` are padding and are never read. The step
  after it is the first step of the next episode.

An episode abandoned by a reset before it ended (gymnasium's
`reset(options={"reset_mask": ...})`, or a full reset mid-run) ends as a
truncation: its final step holds the last observation the env reached
before the reset, flagged `last`, after the episode's last stored step.
That step is the episode's honest last step (its action really led to
that observation), and a truncation is what an episode cut short for a
reason outside the MDP is; `jaxbuf.VectorEnvRecorder` writes it so.

So a truncation bootstraps from the TRUE final observation (SB3's
`optimize_memory_usage` bootstraps from the reset one, SB3 #934), and a
termination stops the return whether or not its final step was added.

One flag marks an episode's end. A step whose pytree has a bool field (or
dict key) named `last` carries its own flag, and the buffer reads episode
ends from it: passing `add(..., episode_end=...)` as well is a `TypeError`,
so the two can never disagree. Steps without a `last` leaf mark the ends
with `add(..., episode_end=...)`, True on the step holding the final
observation: bool `[N]` when `steps` hold one step per env (leaves
`[N, ...]`), bool `[N, T]` when they hold a chunk of T consecutive steps
per env (leaves `[N, T, ...]`). `add`'s `mask` (bool `[N]`) says which
envs stepped; the others write nothing.

Final observations go in the same add, as `final_steps` (one step per
env, `[N, ...]`), in every stream kind: each env whose episode ended
writes its final step after its steps, flagged as the episode's end. Which
envs ended is read from the final steps' own `last` (or, for steps without
a `last` leaf, from `episode_end`, then bool `[N]`: the envs whose episode
ended after their last step in `steps`). The result is, byte for byte, the
two-add masked form::

    state = buffer.add(state, steps, mask)
    state = buffer.add(state, final_steps, ended & mask)   # `last` leaf, or
    #       buffer.add(state, final_steps, ended & mask, episode_end=ended)

whose second mask is the one that gets forgotten: unmasked, every env that
stepped would store a final step, episode over or not.

gymnax (auto-reset inside `env.step`, the pre-reset observation in
`info["final_observation"]`): one add per vector step, the same code for
every stream kind. Here a toy vector env of two envs whose episodes are
cut after 3 steps (truncated), its observations GoalEnv dicts so that
hindsight replay takes them too:

>>> import jax, jax.numpy as jnp, jaxbuf
>>> from typing import NamedTuple
>>> class Step(NamedTuple):
...   obs: dict
...   action: jax.Array
...   reward: jax.Array
...   terminated: jax.Array
...   last: jax.Array
>>> def goal_obs(x):
...   return {"observation": x, "achieved_goal": x, "desired_goal": 0 * x}
>>> def step(obs, action, t):  # auto-resets; info holds the final obs
...   final = goal_obs(obs["observation"] + 1)
...   truncated = jnp.full(2, t % 3 == 2)
...   next_obs = jax.tree.map(
...       lambda x: jnp.where(truncated[:, None], 0 * x, x), final)
...   return (next_obs, jnp.ones(2, jnp.float32), jnp.zeros(2, bool), truncated,
...           {"final_observation": final})
>>> reward_fn = lambda achieved, desired: -jnp.any(
...     achieved != desired, axis=-1).astype(jnp.float32)
>>> kinds = [jaxbuf.sequence_replay(2, 32, 4),
...          jaxbuf.prioritized_sequence_replay(2, 32, 4),
...          jaxbuf.frame_stack_replay(2, 32, 2, n_step=2),
...          jaxbuf.prioritized_frame_stack_replay(2, 32, 2, n_step=2),
...          jaxbuf.hindsight_replay(2, 32, reward_fn),
...          jaxbuf.episode_replay(2, 32, 4)]
>>> no_env = jnp.zeros(2, bool)
>>> for buffer in kinds:
...   obs = goal_obs(jnp.zeros((2, 1), jnp.float32))
...   action = jnp.zeros(2, jnp.int32)
...   state = buffer.init(Step(jax.tree.map(lambda x: x[0], obs), action[0],
...                            jnp.float32(0), no_env[0], no_env[0]))
...   for t in range(6):
...     next_obs, reward, terminated, truncated, info = step(obs, action, t)
...     state = buffer.add(
...         state, Step(obs, action, reward, terminated, last=no_env),
...         # action, reward and terminated of a final step are padding
...         final_steps=Step(info["final_observation"], action, 0 * reward,
...                          no_env, last=terminated | truncated))
...     obs = next_obs  # the reset observation where an episode ended
...   print(f"{buffer.kind.name}: {int(state.steps_held[0])} steps held, "
...         f"can sample: {bool(buffer.can_sample(state, 8))}")
sequence_replay: 8 steps held, can sample: True
prioritized_sequence_replay: 8 steps held, can sample: True
frame_stack_replay: 8 steps held, can sample: True
prioritized_frame_stack_replay: 8 steps held, can sample: True
hindsight_replay: 8 steps held, can sample: True
episode_replay: 8 steps held, can sample: True

Each env's stream holds 3 steps and a final step per episode; the final
observations were written only where an episode ended.

gymnasium vector envs (`AutoresetMode.SAME_STEP`, the final observation in
`info["final_obs"]`), from a Python loop, are the same stream built from
NumPy arrays: `examples/gymnasium_dqn.py` stores item transitions with the
true final observation as `next_obs`; a stream kind takes the step and the
final steps in one add, as above.

Minari's episodes (T + 1 observations) and RLDS's steps (`is_first`,
`is_last`, `is_terminal`) map onto this convention as
`help(jaxbuf.offline)` describes.
"""
