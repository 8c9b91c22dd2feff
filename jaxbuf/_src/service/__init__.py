"""The replay service: host code (threads, locks) around one buffer state,
for actors that step host environments and a learner that trains on the
accelerator (Sebulba, Ape-X). The top layer, above `host` (a writer takes
the recorder's `RecordedStep`).

* `limiters`: Reverb's rate limiters, a few counts and two predicates;
* `closed`: `ServiceClosed`, what a call on a closed service raises;
* `coalescing`: accepted adds and how many become one device call;
* `fifo_reads`: the read cursor a `Queue` service keeps;
* `versions`: the policy version of each stored unit, for `version_lag`;
* `writer`: an actor's handle for adding (`ReplayService.writer`);
* `replay_service`: the service, which owns the state, coalesces adds into
  batched device calls and samples under its rate limiter.
"""
