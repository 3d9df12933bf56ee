"""kvpath: network-aware prefill/decode disaggregation for vLLM."""

__version__ = "0.2.0"
