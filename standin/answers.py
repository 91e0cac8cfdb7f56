"""The stand-in engine's answers: which prompt gets which completion.

The demo profile mounts overlays/demo/standin_answers.py over this file, as production overlays replace
vLLM's files; VARIANT (in /v1/models and the X-Standin-Answers header) shows which copy is in effect.
"""

from __future__ import annotations

VARIANT = "upstream"

# Keys as normalise() leaves prompts.
ANSWERS: dict[str, str] = {
    # The runbook's smoke test.
    "Calculate 17 * 23. Answer with the number only.": "391",
    "What is 2 + 2? Answer with the number only.": "4",
    "Say hello.": "Hello! I am the stand-in engine.",
}


def normalise(prompt: str) -> str:
    return " ".join(prompt.split())


def answer(prompt: str) -> str:
    """The completion for PROMPT: a known answer, else a deterministic echo."""
    key = normalise(prompt)
    if key in ANSWERS:
        return ANSWERS[key]
    return f"echo: {key}" if key else "echo:"
