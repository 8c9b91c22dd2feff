"""End-to-end examples: DQN and PPO on gymnax, each one jitted program."""
