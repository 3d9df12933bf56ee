"""Workloads: who asks for what, when.

- :mod:`~kvpath.workloads.model`: ``Request``, ``Workload`` (and its JSON-lines file),
  ``WorkloadError``;
- :mod:`~kvpath.workloads.generators`: ``zipf`` and ``poisson``;
- :mod:`~kvpath.workloads.importers`: the public traces' readers (Azure, BurstGPT,
  Mooncake) and ``load_file``;
- :mod:`~kvpath.workloads.load`: ``load_workload``, which picks a generator or a reader.
"""

from kvpath.workloads.generators import GENERATORS, poisson, poisson_arrivals, zipf, zipf_lengths
from kvpath.workloads.load import load_workload
from kvpath.workloads.model import Request, Workload, WorkloadError, sample_index

__all__ = ["GENERATORS", "WorkloadError", "Request", "Workload", "sample_index", "zipf_lengths", "poisson_arrivals",
           "zipf", "poisson", "load_workload"]
