"""`ServiceClosed`: what a call on a closed `ReplayService` raises."""


class ServiceClosed(RuntimeError):
  """The replay service was closed: raised by every call after `close()`,
  and by every call that was blocked when it came. When the service was
  closed because of an error (a learner's exception leaving a `with
  service:` block), that error is the `__cause__`."""
