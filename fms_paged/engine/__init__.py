"""Continuous batching over the paged KV cache: `Engine`, `SamplingParams`, `RequestOutput`."""

from fms_paged.engine.engine import Engine
from fms_paged.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from fms_paged.engine.scheduler import Scheduler

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Scheduler", "TokenLogprobs"]
