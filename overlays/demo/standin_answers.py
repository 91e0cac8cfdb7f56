"""The demo overlay of standin/answers.py (mounted read-only over it in the engine container).

The demo profile mounts overlays/demo/standin_answers.py read-only over this file inside the
engine container, the way the production overlays replace vLLM's own files. VARIANT tells which
copy is in effect; the engine reports it in /v1/models and in the X-Standin-Answers header.
"""

from __future__ import annotations

VARIANT = "overlay-demo"

# Prompts are compared after collapsing runs of whitespace (see normalise()).
ANSWERS: dict[str, str] = {
    # The runbook's smoke test.
    "Calculate 17 * 23. Answer with the number only.": "391",
    "What is 2 + 2? Answer with the number only.": "4",
    "Say hello.": "Hello! I am the stand-in engine.",
    # Only in the demo overlay: proves the overlay is mounted.
    "Which answers are these?": "The demo overlay's answers, mounted over standin/answers.py.",
}


def normalise(prompt: str) -> str:
    return " ".join(prompt.split())


def answer(prompt: str) -> str:
    """The completion for PROMPT: a known answer, else a deterministic echo."""
    key = normalise(prompt)
    if key in ANSWERS:
        return ANSWERS[key]
    return f"echo: {key}" if key else "echo:"
