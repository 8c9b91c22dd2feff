"""End-to-end examples, each one jitted program: DQN, n-step DQN, R2D2, frame
stacks, HER and PPO on gymnax, DQN on gymnasium and ALE, offline CQL.

Each script reads as its algorithm plus the jaxbuf calls; `training.py` (how
a run goes) and `q_learning.py` (what the value-based examples share) hold
the rest. examples/README.md says how to write a new one in the same style.
"""
