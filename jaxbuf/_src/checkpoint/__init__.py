"""Saving and loading buffer states: `jaxbuf.save` and `jaxbuf.load`
(`saving`, whose docstring maps the rooms), the agreement between processes
(`agreement`), the arrays through orbax (`arrays`), the directory protocol
(`files`) and the layout as JSON data (`layout`). A top layer: it reads any
buffer state through `core`'s kind protocol and imports nothing but `core`.
"""
