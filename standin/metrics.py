"""Engine counters on /metrics in Prometheus text format, with vLLM V1's metric names, help texts and labels."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
NUM_SPECULATIVE_TOKENS = 7


def _num(value: float) -> str:
    return repr(float(value))


@dataclass
class Stats:
    model_name: str
    kv_cache_tokens: int
    running: int = 0
    waiting: int = 0
    tokens_in_use: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    created: float = field(default_factory=time.time)
    _seen_prompts: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, delta: int) -> None:
        """A request enters (+1) or leaves (-1) the queue the engine core has not scheduled."""
        with self._lock:
            self.waiting += delta

    def abort_waiting(self) -> None:
        """A request aborted before it was ever scheduled."""
        with self._lock:
            self.requests_finished["abort"] = self.requests_finished.get("abort", 0) + 1

    def token(self) -> None:
        """One token generated: vLLM counts each engine step's tokens as they come, not at the end."""
        with self._lock:
            self.generation_tokens += 1

    def start(self, prompt: str, prompt_tokens: int) -> None:
        """A request enters the batch; its prompt is looked up in the 'prefix cache'."""
        with self._lock:
            self.running += 1
            self.tokens_in_use += prompt_tokens
            self.prefix_queries += prompt_tokens
            if prompt in self._seen_prompts:
                self.prefix_hits += prompt_tokens
            self._seen_prompts.add(prompt)
            self.prompt_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_counts[i] += 1
                    break
            else:
                self.ttft_counts[-1] += 1

    def finish(self, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        """A request leaves the batch after COMPLETION_TOKENS tokens (each counted by token()), finished
        for REASON: stop, length, or abort (its client went away, vLLM's FinishReason.ABORT)."""
        with self._lock:
            self.running -= 1
            self.tokens_in_use -= prompt_tokens
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
            # Each step drafts NUM_SPECULATIVE_TOKENS tokens and yields about 3 tokens.
            if completion_tokens == 0:
                return
            steps = -(-completion_tokens // 3)
            self.drafts += steps
            self.draft_tokens += steps * NUM_SPECULATIVE_TOKENS
            self.accepted_tokens += max(0, completion_tokens - steps)

    def render(self) -> str:
        with self._lock:
            labels = f'engine="0",model_name="{self.model_name}"'
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")
                out.append(f"{name}{{{extra}{labels}}} {_num(value)}")

            def counter(name: str, help_: str, value: float) -> None:
                metric(f"{name}_total", "counter", help_, value)
                metric(f"{name}_created", "gauge", help_, self.created)

            usage = min(1.0, self.tokens_in_use / self.kv_cache_tokens) if self.kv_cache_tokens else 0.0
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   self.running)
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.waiting)
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    self.prefix_queries)
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    self.prefix_hits)
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
            counter("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
            help_ = "Count of successfully processed requests."
            out.append(f"# HELP vllm:request_success_total {help_}")
            out.append("# TYPE vllm:request_success_total counter")
            for reason in ("stop", "length", "abort"):
                count = self.requests_finished.get(reason, 0)
                out.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                           f'model_name="{self.model_name}"}} {_num(count)}')
            name = "vllm:time_to_first_token_seconds"
            out.append(f"# HELP {name} Histogram of time to first token in seconds.")
            out.append(f"# TYPE {name} histogram")
            cumulative = 0
            for bound, count in zip((*TTFT_BUCKETS, None), self.ttft_counts, strict=True):
                cumulative += count
                le = "+Inf" if bound is None else repr(bound)
                out.append(f'{name}_bucket{{engine="0",le="{le}",model_name="{self.model_name}"}} {_num(cumulative)}')
            out.append(f"{name}_count{{{labels}}} {_num(cumulative)}")
            out.append(f"{name}_sum{{{labels}}} {_num(self.ttft_sum)}")
            counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", self.drafts)
            counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", self.draft_tokens)
            counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", self.accepted_tokens)
            return "\n".join(out) + "\n"
