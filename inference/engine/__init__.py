"""The inference engine: pure Python and PyTorch, no Django.

Import the pieces from their modules, e.g. `from inference.engine.engine import LLMEngine`;
this package file stays empty so importing it never loads torch or a model.
"""
