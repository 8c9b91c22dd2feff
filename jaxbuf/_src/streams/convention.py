"""The stream convention: how an env's experience is stored as one stream of
steps, for every kind that stores streams (`sequence_replay`,
`prioritized_sequence_replay`, `hindsight_replay`, `episode_replay`,
`frame_stack_replay`) and the functions that read them
(`n_step_transitions`, `n_step_targets`, `from_minari`). This is its one
home; `help(jaxbuf.streams)` shows it, and each of those functions points
here.

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

So a truncation bootstraps from the TRUE final observation (SB3's
`optimize_memory_usage` bootstraps from the reset one, SB3 #934), and a
termination stops the return whether or not its final step was added.

One flag marks an episode's end. A step whose pytree has a bool field (or
dict key) named `last` carries its own flag, and the buffer reads episode
ends from it: passing `add(..., episode_end=...)` as well is a `TypeError`,
so the two can never disagree. Steps without a `last` leaf mark the ends
with `add(..., episode_end=...)`, bool `[N]` or `[N, T]`, True on the step
holding the final observation. `add`'s `mask` (bool `[N]`) says which envs
stepped; the others write nothing.

gymnax (auto-reset inside `env.step`, the pre-reset observation in
`info["final_observation"]`): one add per vector step, the final
observations of the envs that ended as `final_steps` (sequence and
prioritized sequence replay), written exactly where their own `last` is
True, so no mask can be forgotten::

    next_obs, env_state, reward, terminated, truncated, info = step(...)
    state = buffer.add(
        state, Step(obs, action, reward, terminated, last=no_env),
        # action, reward and terminated of a final step are padding
        final_steps=Step(info["final_observation"], action, 0 * reward,
                         no_env, last=terminated | truncated))
    obs = next_obs  # the reset observation where an episode ended

gymnasium vector envs (`AutoresetMode.SAME_STEP`, the final observation in
`info["final_obs"]`), from a Python loop, are the same stream built from
NumPy arrays: `examples/gymnasium_dqn.py` stores item transitions with the
true final observation as `next_obs`; for a stream kind, add the step and,
for the envs that ended, the final step with `last` True.

Minari's episodes (T + 1 observations) and RLDS's steps (`is_first`,
`is_last`, `is_terminal`) map onto this convention as
`help(jaxbuf.offline)` describes.
"""
