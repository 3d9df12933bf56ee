"""kvpath.testbed: an emulated leaf-spine fabric in network namespaces, emulated and vLLM engines on it,
P/D runs and their traces."""
