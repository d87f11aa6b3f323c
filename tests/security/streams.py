"""A live stream beside other work: how long it waited between chunks while that work ran."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import openai


def stream_gaps_while(srv, work: Callable[[], Any]) -> tuple[list[float], Any]:
    """Run ``work()`` on a thread while streaming 32-token completions back to back; return the
    streams' inter-chunk gaps (seconds) and ``work``'s result."""
    oai = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()))
    gaps: list[float] = []
    thread.start()
    try:
        while thread.is_alive():
            last = None
            for _ in oai.completions.create(model=srv.model_id, prompt="The sky", max_tokens=32, stream=True,
                                            extra_body={"ignore_eos": True}):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    finally:
        thread.join()
    return gaps, out[0]
