"""Loops that step their environments on the host: `VectorEnvRecorder`
(`vector_envs`) turns a gymnasium vector env's steps into buffer adds. On
top of the layers: it writes the item and stream forms of `offline`.
"""
