"""A stand-in for vLLM: its HTTP API and startup lines, without GPU or model (standard library only).

Runs as the demo profile's engine and in the tests; see `python3 -m standin --help`.
"""

__version__ = "0.1.0"
