"""Path reservation: which lane (and so which spine) a P->D push takes.

- :mod:`~kvpath.reservation.decisions`: ``ReservationService``, the decisions of the
  ``ecmp``, ``cc`` and ``dc`` modes, leases and releases;
- :mod:`~kvpath.reservation.wire`: the HTTP API's paths, bodies and vocabularies, and the
  callers' protocols (msgspec only: P's connector imports it inside vLLM);
- :mod:`~kvpath.reservation.link_loads`: what each mode counts on a link, and ``dc``'s
  delayed view of it;
- :mod:`~kvpath.reservation.replay`: a stored decision log replayed, lane for lane.

The HTTP service and its clients are ``kvpath.proxy.reservation_app`` and
``kvpath.proxy.reservation_client``; P's queued client is
``kvpath.connector.reservation_hooks``.
"""
