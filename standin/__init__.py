"""A stand-in for vLLM: speaks its HTTP API and prints its startup lines, with no GPU and no model.

Used by the demo profile (in place of the vLLM image) and by the tests. Standard library only.
Run `python3 -m standin --help`.
"""

__version__ = "0.1.0"
