"""Path reservation: which lane (and so which spine) a P->D push takes.

- :mod:`~kvpath.reservation.decisions`: ``ReservationService``, the decisions of the
  ``ecmp``, ``cc`` and ``dc`` modes, leases and releases;
- :mod:`~kvpath.reservation.lane_registry`: the lanes each (P worker, D worker) pair
  registered and the candidates a decision chooses among (the service's registry);
- :mod:`~kvpath.reservation.lane_log`: the registry's changes, bounded, for replay;
- :mod:`~kvpath.reservation.wire`: the HTTP API's paths, bodies and vocabularies, and the
  callers' protocols (msgspec only: P's connector imports it inside vLLM);
- :mod:`~kvpath.reservation.link_loads`: what each mode counts on a link, and ``dc``'s
  delayed view of it;
- :mod:`~kvpath.reservation.placer`: joint placement, P, D and the lane in one decision
  by the shared cost model (``kvpath.placement``);
- :mod:`~kvpath.reservation.replay`: a stored decision log replayed, lane for lane and
  placement for placement;
- :mod:`~kvpath.reservation.app`: the HTTP service (FastAPI; the only module here that
  imports a web framework), run by ``kvpath reservation`` or mounted in the proxy;
- :mod:`~kvpath.reservation.clients`: the proxy's clients, in process and over HTTP;
- :mod:`~kvpath.reservation.shards`: the proxy's client of several services, one per
  group of leaves;
- :mod:`~kvpath.reservation.notifier`: P's connector's queued client and its token;
- :mod:`~kvpath.reservation.cli`: the ``kvpath reservation`` command, and the options the
  proxy shares with it for a service in its own process.
"""
