"""FetchReach: a jitted SAC learner on `hindsight_replay` against SB3's SAC +
`HerReplayBuffer`, side by side (success rate and env steps per second).

  python benchmarks/peers/bench_fetch_reach.py                   # 20k steps, 2 seeds
  python benchmarks/peers/bench_fetch_reach.py --steps 5000 --seeds 0

Needs gymnasium-robotics and MuJoCo from PyPI (`pip install
gymnasium-robotics "mujoco==3.3.7"`; gymnasium-robotics 1.4.2 fails to reset
FetchReach under mujoco 4.0.0 and 3.17.0, an assertion on the joint type in
`set_joint_qpos`). Physics only, no rendering.

Both learners get the same budget and settings, those of rl-baselines3-zoo's
FetchReach entry: one env, episodes of 50 steps (time limit, never
terminated), SAC with automatic entropy, two critics of [64, 64], learning
rate 1e-3, gamma 0.95, tau 0.005, batch 256, 1,000 random steps first, one
gradient step per env step; HER "future" with 4 sampled goals per transition
(relabel fraction 0.8). The observation given to the networks is the
concatenation of "observation", "achieved_goal" and "desired_goal", as
SB3's `MultiInputPolicy` does. jaxbuf's loop adds each episode as one chunk
of 51 stream steps (the final observation its own step, so the time limit
bootstraps) and runs the episode's 50 gradient steps in one jitted
`lax.scan`; SB3 steps its usual Python loop (torch on CPU, one thread).

Success: the share of 50 evaluation episodes (deterministic policy, seeds
apart from training) whose last step has `is_success`. Steps per second:
the 20k training steps over the wall time of `learn` / the loop, compilation
included.
"""

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
import jaxbuf  # noqa: E402
from benchmarks.common import harness

ENV_ID = "FetchReach-v4"
EPISODE = 50
HIDDEN = (64, 64)
LEARNING_RATE, GAMMA, TAU, BATCH = 1e-3, 0.95, 0.005, 256
RANDOM_STEPS = 1000
EVAL_EPISODES = 50


def make_env():
  import gymnasium as gym  # pylint: disable=import-outside-toplevel
  import gymnasium_robotics  # pylint: disable=import-outside-toplevel

  gym.register_envs(gymnasium_robotics)
  return gym.make(ENV_ID)


def reward_fn(achieved_goal, desired_goal):
  """FetchReach's sparse reward: -1 until within 5 cm of the goal."""
  distance = jnp.linalg.norm(achieved_goal - desired_goal, axis=-1)
  return -(distance > 0.05).astype(jnp.float32)


def success_rate(env, act) -> float:
  """The share of `EVAL_EPISODES` episodes of `act(obs) -> action` (seeds
  apart from training) whose last step has `is_success`."""
  successes = []
  for episode in range(EVAL_EPISODES):
    obs, _ = env.reset(seed=10_000 + episode)
    for _ in range(EPISODE):
      obs, _, _, _, info = env.step(act(obs))
    successes.append(float(info["is_success"]))
  return float(np.mean(successes))


def flat(obs):
  return jnp.concatenate([obs["observation"], obs["achieved_goal"], obs["desired_goal"]], axis=-1)


# ------------------------------------------------------------------ jaxbuf SAC


def dense_init(key, sizes):
  layers = []
  for layer_key, (fan_in, fan_out) in zip(
    jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])
  ):
    bound = 1 / np.sqrt(fan_in)
    w_key, b_key = jax.random.split(layer_key)
    layers.append(
      (
        jax.random.uniform(w_key, (fan_in, fan_out), minval=-bound, maxval=bound),
        jax.random.uniform(b_key, (fan_out,), minval=-bound, maxval=bound),
      )
    )
  return layers


def dense(layers, x):
  for w, b in layers[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = layers[-1]
  return x @ w + b


def policy(actor, obs, key, deterministic=False):
  """A tanh-squashed Gaussian action and its log-probability."""
  mean, log_std = jnp.split(dense(actor, obs), 2, axis=-1)
  log_std = jnp.clip(log_std, -20, 2)
  raw = mean if deterministic else (mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape))
  action = jnp.tanh(raw)
  log_prob = jnp.sum(
    jax.scipy.stats.norm.logpdf(raw, mean, jnp.exp(log_std)) - jnp.log(1 - action**2 + 1e-6),
    axis=-1,
  )
  return action, log_prob


def q_values(critics, obs, action):
  x = jnp.concatenate([obs, action], axis=-1)
  return jnp.stack([dense(critic, x)[..., 0] for critic in critics])


def init_learner(key, obs_size, action_size):
  actor_key, *critic_keys = jax.random.split(key, 3)
  params = {
    "actor": dense_init(actor_key, (obs_size, *HIDDEN, 2 * action_size)),
    "critics": [dense_init(k, (obs_size + action_size, *HIDDEN, 1)) for k in critic_keys],
    "log_alpha": jnp.zeros(()),
  }
  optimizer = optax.adam(LEARNING_RATE)
  return {
    "params": params,
    "target": jax.tree.map(jnp.copy, params["critics"]),
    "opt": {name: optimizer.init(params[name]) for name in params},
  }


def sac_update(learner, batch, key, action_size):
  optimizer = optax.adam(LEARNING_RATE)
  params = learner["params"]
  obs, next_obs = flat(batch.items.obs), flat(batch.items.next_obs)
  action, reward = batch.items.action, batch.items.reward
  discount = batch.items.discount  # gamma, 0 where terminated
  next_key, actor_key = jax.random.split(key)
  alpha = jnp.exp(params["log_alpha"])
  next_action, next_log_prob = policy(params["actor"], next_obs, next_key)
  target_q = jnp.min(q_values(learner["target"], next_obs, next_action), 0)
  target = jax.lax.stop_gradient(reward + discount * (target_q - alpha * next_log_prob))

  def critic_loss(critics):
    return jnp.mean((q_values(critics, obs, action) - target) ** 2)

  def actor_loss(actor, critics):
    new_action, log_prob = policy(actor, obs, actor_key)
    q = jnp.min(q_values(critics, obs, new_action), 0)
    return jnp.mean(alpha * log_prob - q), log_prob

  def alpha_loss(log_alpha, log_prob):
    return -jnp.mean(log_alpha * jax.lax.stop_gradient(log_prob - action_size))

  new_params, new_opt = {}, {}

  def apply(name, grads):
    updates, new_opt[name] = optimizer.update(grads, learner["opt"][name])
    new_params[name] = optax.apply_updates(params[name], updates)

  # In SB3's order: the critics first, the actor against the updated ones.
  apply("critics", jax.grad(critic_loss)(params["critics"]))
  actor_grads, log_prob = jax.grad(actor_loss, has_aux=True)(params["actor"], new_params["critics"])
  apply("actor", actor_grads)
  apply("log_alpha", jax.grad(alpha_loss)(params["log_alpha"], log_prob))
  target = optax.incremental_update(new_params["critics"], learner["target"], TAU)
  return {"params": new_params, "target": target, "opt": new_opt}


def run_jaxbuf(seed: int, steps: int) -> dict:
  env = make_env()
  action_size = env.action_space.shape[0]
  buffer = jaxbuf.hindsight_replay(
    1, 1 << 16, reward_fn, strategy="future", relabel_fraction=0.8, gamma=GAMMA
  )
  obs, _ = env.reset(seed=seed)
  step = {
    "obs": {k: jnp.asarray(v, jnp.float32) for k, v in obs.items()},
    "action": jnp.zeros(action_size, jnp.float32),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  state = buffer.init(step)
  obs_size = sum(v.shape[0] for v in obs.values())
  key = jax.random.key(seed)
  key, init_key = jax.random.split(key)
  learner = init_learner(init_key, obs_size, action_size)

  @jax.jit
  def act(actor, obs, key):
    return policy(actor, flat(obs), key)[0]

  @jax.jit
  def act_greedy(actor, obs):
    return policy(actor, flat(obs), None, deterministic=True)[0]

  @functools.partial(jax.jit, donate_argnums=0)
  def train(learner, buffer_state, key):
    def one(learner, key):
      sample_key, update_key = jax.random.split(key)
      batch = buffer.sample(buffer_state, sample_key, BATCH)
      return sac_update(learner, batch, update_key, action_size), None

    return jax.lax.scan(one, learner, jax.random.split(key, EPISODE))[0]

  rng = np.random.default_rng(seed)
  env.action_space.seed(seed)
  start = time.perf_counter()
  done_steps = 0
  while done_steps < steps:
    obs, _ = env.reset(seed=int(rng.integers(2**31)))
    episode = {"obs": [], "action": [], "reward": []}
    for _ in range(EPISODE):
      if done_steps < RANDOM_STEPS:
        action = env.action_space.sample()
      else:
        key, act_key = jax.random.split(key)
        action = np.asarray(act(learner["params"]["actor"], obs, act_key))
      next_obs, reward, _, _, _ = env.step(action)
      episode["obs"].append(obs)
      episode["action"].append(action)
      episode["reward"].append(reward)
      obs = next_obs
      done_steps += 1
    # The final observation as a step of its own (episode_end): the time
    # limit bootstraps from it; its action and reward are padding.
    episode["obs"].append(obs)
    episode["action"].append(np.zeros(action_size, np.float32))
    episode["reward"].append(0.0)
    chunk = {
      "obs": {k: np.stack([o[k] for o in episode["obs"]])[None].astype(np.float32) for k in obs},
      "action": np.stack(episode["action"])[None].astype(np.float32),
      "reward": np.asarray(episode["reward"], np.float32)[None],
      "terminated": np.zeros((1, EPISODE + 1), bool),
    }
    ends = np.zeros((1, EPISODE + 1), bool)
    ends[0, -1] = True
    state = buffer.add(state, chunk, episode_end=ends)
    if done_steps >= RANDOM_STEPS:
      key, train_key = jax.random.split(key)
      learner = train(learner, state, train_key)
  jax.block_until_ready(learner)
  elapsed = time.perf_counter() - start
  return {
    "success": success_rate(
      env, lambda obs: np.asarray(act_greedy(learner["params"]["actor"], obs))
    ),
    "steps_per_s": steps / elapsed,
  }


# ------------------------------------------------------------------ SB3


def run_sb3(seed: int, steps: int) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  from stable_baselines3 import SAC, HerReplayBuffer  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(1)
  env = make_env()
  model = SAC(
    "MultiInputPolicy",
    env,
    replay_buffer_class=HerReplayBuffer,
    replay_buffer_kwargs=dict(n_sampled_goal=4, goal_selection_strategy="future"),
    learning_rate=LEARNING_RATE,
    gamma=GAMMA,
    tau=TAU,
    batch_size=BATCH,
    learning_starts=RANDOM_STEPS,
    buffer_size=1_000_000,
    train_freq=1,
    gradient_steps=1,
    policy_kwargs=dict(net_arch=list(HIDDEN)),
    seed=seed,
    device="cpu",
  )
  start = time.perf_counter()
  model.learn(steps)
  elapsed = time.perf_counter() - start
  return {
    "success": success_rate(env, lambda obs: model.predict(obs, deterministic=True)[0]),
    "steps_per_s": steps / elapsed,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=20_000)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--learners", nargs="+", default=["jaxbuf", "sb3"], choices=["jaxbuf", "sb3"])
  args = parser.parse_args()
  harness.print_machine(
    harness.PACKAGES + ("stable_baselines3", "torch", "gymnasium", "gymnasium-robotics", "mujoco")
  )
  runs = {"jaxbuf": run_jaxbuf, "sb3": run_sb3}
  rows = []
  for seed in args.seeds:
    for name in args.learners:
      result = runs[name](seed, args.steps)
      print(
        f"{name} seed {seed}: success {result['success']:.2f}, "
        f"{result['steps_per_s']:.0f} env steps/s",
        flush=True,
      )
      rows.append((name, seed, result))
  print(
    f"\n{ENV_ID}, {args.steps} env steps per seed, success over "
    f"{EVAL_EPISODES} deterministic episodes"
  )
  harness.print_table(
    [("learner", -34), ("seed", 5), ("success", 8), ("steps/s", 9)],
    [
      (
        "jaxbuf hindsight_replay + jitted SAC" if name == "jaxbuf" else "SB3 SAC + HerReplayBuffer",
        seed,
        f"{result['success']:.2f}",
        f"{result['steps_per_s']:.0f}",
      )
      for name, seed, result in rows
    ],
  )
  harness.print_load_average_after()


if __name__ == "__main__":
  main()
