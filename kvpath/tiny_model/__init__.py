"""The tiny model that tests and demos build locally (no weights are downloaded).

- :mod:`~kvpath.tiny_model.build`: a small Llama and its tokenizer written as a model
  directory vLLM loads, random or trained, cached per machine, and ``kvpath model``
  (its names are re-exported here: ``from kvpath.tiny_model import build_tiny_model``);
- :mod:`~kvpath.tiny_model.training`: training it for seconds on the text the package
  ships (``data/corpus.txt``), and prompts drawn from that text.
"""

from kvpath.tiny_model.build import MARKER, TinyModelSpec, add_parsers, build_tiny_model, write_tiny_model

__all__ = ["MARKER", "TinyModelSpec", "add_parsers", "build_tiny_model", "write_tiny_model"]
