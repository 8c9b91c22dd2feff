"""`jaxbuf.ray`: a `jaxbuf.ReplayService` served to Ray actors and tasks in
other processes and on other hosts.

Ray is the distributed engine (actors, the object store); this module is
the optional extra `jaxbuf[ray]` and `import jaxbuf` never imports it.

    served = jaxbuf.ray.serve(service, name="replay")   # the learner's process
    writer = served.writer()                            # in a Ray actor: the Writer API
    writer.add(items, policy_version=7, timeout=10.0)
    sample = served.sample(key, 256, timeout=10.0)      # a remote sampler
    served = jaxbuf.ray.connect("replay")                # any process: found by name

The rate limiter, versions, `close()` and checkpoints mean what they mean
in one process. Guide: `docs/guides/ray.md`.
"""

from jaxbuf._src.fleet.client import RemoteWriter
from jaxbuf._src.fleet.client import Served
from jaxbuf._src.fleet.client import connect
from jaxbuf._src.fleet.server import serve

__all__ = (
  "RemoteWriter",
  "Served",
  "connect",
  "serve",
)
