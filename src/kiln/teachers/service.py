"""The teacher side of a running server: its own teacher identity and the registry.

Built once by the composition root (:func:`build_teachers`); the scoring route
asks :meth:`TeacherService.scoring_fingerprint` for the ``kiln-teacher-v1``
fingerprint of the model or adapter a request ran on, and ``/v1/teachers``
uses :attr:`TeacherService.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.teachers.kiln_identity import KilnTeacherIdentity
from kiln.teachers.probe import PROBE_TEXT_IDS, LocalTeacher, StudentFacts
from kiln.teachers.registry import TeacherRegistry

PROBE_TEXT = "The teacher probe scores these words."


class TeacherService:
    def __init__(self, *, settings: Any, model: Any, engine: Any, store: Any):
        self.settings, self.model, self.engine, self.store = settings, model, engine, store
        max_k = min(settings.limits.max_prompt_logprobs, 1000)
        self.identity = KilnTeacherIdentity(model, max_model_len=engine.config.max_model_len, max_top_k=max_k)
        self._student: StudentFacts | None = None
        self.registry = TeacherRegistry(
            settings.teachers_registry_path, credentials=dict(settings.teachers.credentials),
            server_host=settings.server.host, timeout_s=settings.teachers.request_timeout_s,
            student=self.student, local_teacher=self.local_teacher)

    def student(self) -> StudentFacts:
        if self._student is None:
            ids = self.model.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)[:PROBE_TEXT_IDS]
            if len(ids) < 2:
                ids = [0, 1]
            self._student = StudentFacts(self.identity.vocab_size, self.identity.tokenizer()[0], tuple(ids))
        return self._student

    def _adapter_ref(self, adapter: str) -> tuple[str, str, Path]:
        from kiln.errors import NotFound

        revision = self.engine.active_adapters().get(adapter)
        if revision is None:
            raise NotFound(f"adapter {adapter!r} is not loaded", code="adapter_not_loaded",
                           hint="load it with POST /v1/adapters/{name}/load first")
        record = self.store.get(adapter, revision)
        return adapter, revision, Path(record.path)

    def scoring_fingerprint(self, adapter: str | None) -> str | None:
        """The fingerprint a scoring answer on the base model (``None``) or ``adapter`` carries; ``None``
        when this server cannot act as a teacher (``limits.max_prompt_logprobs = 0``)."""
        if not self.identity.usable:
            return None
        if adapter is None:
            return self.identity.identity(self.model.model_id).fingerprint()
        try:
            ref = self._adapter_ref(adapter)
        except Exception:  # noqa: BLE001 - served but not in the store (or swapped meanwhile): no teacher identity
            return None
        return self.identity.identity(adapter, ref).fingerprint()

    def manifest(self, model: str | None) -> dict[str, Any]:
        """This server's teacher manifest for the base model (``None`` or its ID) or a loaded adapter: the
        identity, its fingerprint and the inference document behind ``inference_config_sha256``
        (:mod:`kiln.teachers.inference_proof`)."""
        from kiln.errors import Conflict

        if not self.identity.usable:
            raise Conflict("this server does not act as a teacher (limits.max_prompt_logprobs is 0)",
                           code="teacher_unavailable", hint="set limits.max_prompt_logprobs to at least 1")
        if model is None or model == self.model.model_id:
            return self.identity.manifest(self.model.model_id)
        return self.identity.manifest(model, self._adapter_ref(model))

    def local_teacher(self, adapter: str | None) -> LocalTeacher:
        if adapter is not None:
            self._adapter_ref(adapter)
        model_id = adapter or self.model.model_id
        return LocalTeacher(self.engine, model_id, adapter=adapter,
                            fingerprint=lambda: self.scoring_fingerprint(adapter) or "")


def build_teachers(settings: Any, model: Any, engine: Any, store: Any) -> TeacherService:
    return TeacherService(settings=settings, model=model, engine=engine, store=store)
