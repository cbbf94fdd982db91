"""Prometheus metrics of the server, named as vLLM names them with our prefix (`fms_paged:`), in a
registry of the server's own (no process-global state).

Gauges (requests running / waiting, KV-cache usage) and the engine's prefix-cache and preemption
counters are read from `Engine.metrics()` by the engine loop after its steps; per-request figures
(latencies, token counts, finish reasons) are observed once, from a request's final output, and
then dropped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "fms_paged:"
# vLLM's buckets, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("num_requests_running", "Requests decoding or prefilling.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=r)
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        # ours, not vLLM's: what the HTTP layer adds to a stream's first token
        self.first_chunk_delay = histogram(
            "first_chunk_delay_seconds", "Streams: the engine's first token made to its chunk sent.",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        # speculative decoding (vLLM's names), where the engine speculates
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications run.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_rate = gauge("spec_decode_acceptance_rate", "Accepted / proposed tokens since start.")
        self.spec_length = gauge("spec_decode_mean_accepted_length",
                                 "Mean proposed tokens accepted per verification since start.")
        self._engine_seen = {"preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                             "spec_verifies": 0, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0}

    def engine_state(self, m: dict) -> None:
        """Gauges and counters from `Engine.metrics()` (engine loop thread)."""
        self.running.set(m["running"])
        self.waiting.set(m["waiting"])
        self.kv_usage.set(m["kv_used_pct"] / 100.0)
        for key, counter in (("preemptions", self.preemptions),
                             ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits),
                             ("spec_verifies", self.spec_drafts),
                             ("spec_proposed_tokens", self.spec_draft_tokens),
                             ("spec_accepted_tokens", self.spec_accepted)):
            value = m.get(key, 0)
            if value > self._engine_seen[key]:
                counter.inc(value - self._engine_seen[key])
            self._engine_seen[key] = value
        if m.get("spec_acceptance_rate") is not None:
            self.spec_rate.set(m["spec_acceptance_rate"])
            self.spec_length.set(m["spec_mean_accepted_length"])

    def finished(self, stats: dict, first_of_request: bool) -> None:
        """A completion's final statistics (`RequestOutput.stats`); its prompt counts once per
        request (`first_of_request`), whatever its `n`."""
        self._success.labels(finished_reason=stats["finish_reason"], **self._labels).inc()
        if first_of_request:
            self.prompt_tokens.inc(stats["prompt_tokens"])
        for key, hist in (("ttft", self.ttft), ("e2e", self.e2e), ("queue", self.queue)):
            if stats.get(key) is not None:
                hist.observe(stats[key])
        for gap in stats.get("itl") or ():
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
