"""A `ReplayService` served to Ray actors and tasks in other processes and
on other hosts (`jaxbuf.ray`; the optional extra `[ray]`). The top layer,
above `service`; only `jaxbuf.ray` imports it, so `import jaxbuf` never
imports Ray.

* `broker`: the small Ray actor that relays calls to the learner's process
  (a Ray driver cannot receive calls) and holds the published parameters;
* `wire`: what travels (chunks, keys, replies) and the ingress's checks;
* `client`: `Served`, the handle actors hold, and `RemoteWriter`;
* `server`: `serve`, and the learner-side threads that run remote calls on
  the local service.
"""
