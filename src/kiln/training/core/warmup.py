"""Warm-up at server start: build what a first training job would otherwise build on its own clock.

A correction's submit -> served time (issue 48: <= 2 s for one correction on the built-in model) is mostly the
job's own steps once the lazily built pieces exist. The first job of a process used to build them itself:

* the KL-to-base anchor rows with the default settings (:func:`kiln.training.core.anchor.model_anchor`: the base
  model writes and answers ``DEFAULT_ANCHOR_QUESTIONS`` questions),
* the locality probe set with the server's ``[locality]`` settings and no user probes
  (:func:`kiln.training.core.locality.served_probe_set`),
* the training modules' imports and PEFT's first private adapter (a throwaway one, added and deleted).

:class:`WarmUp` does these once, in the training worker thread before it claims its first job
(:class:`kiln.training.queue.service.TrainingService`), each step under exclusive ownership of the model as a job
would take it, so serving keeps its turns. Both caches are keyed exactly as a job's look-ups are, so a job with the
defaults finds them built. ``training.warm_up = false`` (``KILN_TRAINING_WARM_UP=0``) turns it off; its state is
``GET /v1/train/status``'s ``warm_up``. A failure is logged and recorded there and changes nothing else: the first
job then builds what is missing itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("kiln.training")

WARM_UP_ADAPTER = "kiln-warm-up"  # the throwaway private adapter's name (never published or served)


class WarmUp:
    """One warm-up's state (``off``, ``pending``, ``running``, ``done``, ``failed``), its per-piece seconds and
    error; :meth:`run` does it (once)."""

    def __init__(self, *, enabled: bool):
        self._lock = threading.Lock()
        self.state = "pending" if enabled else "off"
        self.seconds: dict[str, float] = {}
        self.error: str | None = None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "seconds": dict(self.seconds),
                    **({"error": self.error} if self.error is not None else {})}

    def run(self, engine: Any, loaded: Any, locality: Any, should_stop: Any = lambda: False) -> None:
        """Build the default anchor, the probe set and a throwaway adapter on ``engine``'s model ``loaded``
        (``locality``: the server's ``settings.locality``); ``should_stop()`` is asked between pieces."""
        with self._lock:
            if self.state != "pending":
                return
            self.state = "running"
        try:
            for name, piece in (("imports", _imports), ("adapter", _throwaway_adapter), ("anchor", _anchor),
                                ("probes", _probes)):
                if should_stop():
                    break
                t0 = time.perf_counter()
                piece(engine, loaded, locality)
                with self._lock:
                    self.seconds[name] = round(time.perf_counter() - t0, 4)
        except Exception as exc:  # noqa: BLE001 - recorded; a first job builds what is missing itself
            log.warning("training warm-up failed (the first job builds what it needs): %s: %s",
                        type(exc).__name__, exc)
            with self._lock:
                self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self.state = "done"
        log.info("training warm-up done: %s", self.seconds)


def _imports(engine: Any, loaded: Any, locality: Any) -> None:
    import kiln.training.core.loop  # noqa: F401 - every job's loop (and core.step)
    import kiln.training.losses.kd  # noqa: F401 - the anchor's loss


def _throwaway_adapter(engine: Any, loaded: Any, locality: Any) -> None:
    """PEFT's first private adapter (its module injection) and a first optimizer step's kernels, on a throwaway
    adapter with SFT's default LoRA shape."""
    import torch

    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.core.plan import correction_target_modules, linear_module_suffixes
    from kiln.training.schemas import DEFAULT_LORA_RANK

    targets = correction_target_modules(linear_module_suffixes(loaded.model))  # a correction's (SFT's) shape
    peft_model = engine.peft_model()  # takes ownership itself: before exclusive()
    try:
        with engine.ownership.exclusive():
            params = add_private_adapter(peft_model, WARM_UP_ADAPTER,
                                         lora_config(DEFAULT_LORA_RANK, 2 * DEFAULT_LORA_RANK, targets), seed=0)
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
            ids = torch.tensor([engine.encode_text("Hello.")], device=params[0].device)
            peft_model(input_ids=ids, use_cache=False).logits.float().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        engine.delete_private_adapter(WARM_UP_ADAPTER)


def _anchor(engine: Any, loaded: Any, locality: Any) -> None:
    from kiln.training.core.anchor import AnchorSettings, model_anchor

    peft_model = engine.peft_model()
    with engine.ownership.exclusive():
        model_anchor(peft_model, loaded, AnchorSettings())


def _probes(engine: Any, loaded: Any, locality: Any) -> None:
    from kiln.config import LocalitySettings
    from kiln.training.core.locality import served_probe_set

    section = locality if locality is not None else LocalitySettings()
    if not section.measure:
        return
    peft_model = engine.peft_model()
    with engine.ownership.exclusive():
        served_probe_set(peft_model, loaded, engine, section)
