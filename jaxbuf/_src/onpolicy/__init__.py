"""On-policy data: the time-major rollout buffer (`rollout`), its minibatches
(`minibatch`) and the returns and advantages computed over it (`advantages`:
`compute_gae`, `lambda_returns`, `n_step_returns`). Above `core` and importing
nothing else; nothing else in `jaxbuf._src` imports it.
"""
