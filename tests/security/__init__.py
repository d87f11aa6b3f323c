"""Reproductions of the API-surface issue, one file per theme; each failed on the code before the fix.

| file | issue item | what it proves |
|---|---|---|
| ``test_composition.py`` | 1 typed composition root | ``KilnState`` fields typed (no ``Any``); one ``AdapterStore`` built in ``serving/state.py`` and shared by the adapter routes and the training service; no duck-typed ``attach_training`` |
| ``test_schemas.py`` | 2 responses match their schemas | every JSON body and SSE event of the scenarios (chat, completions, streams, errors, models, training, adapters, health, config) validates against ``/openapi.json`` and the pydantic models |
| ``test_openapi.py`` | 3 documented statuses | no 422, errors documented with the envelope, ``text/event-stream`` on streaming routes |
| ``test_fuzz.py`` | 3 schemathesis | bounded run (10 examples per operation, ~850 requests) against a live server: 0 5xx, 0 undocumented statuses or media types, bodies match; skips training submissions and ``/v1/evals`` |
| ``test_browser.py`` | 4 browser and exposure defences | cross-origin ``text/plain`` load/upload refused (403), simple content types 415, foreign ``Host`` 403 (DNS rebinding), CORS only for configured origins, optional bearer key (401), ``/health`` open |
| ``test_slow_clients.py`` | 5 slow clients | a raw socket dribbling the request head is closed after ``server.header_timeout_s``; a dribbled body gets 408 after ``server.body_timeout_s`` and the connection closes; a head over 64 KiB gets 431; 400 such connections at once are all dropped and the server keeps answering |
| ``test_exposure.py`` | 6 exposure | ``$KILN_HOME`` and state dirs 0700, start-up files 0600; no absolute path in ``/v1/models``, job results or error messages |

``tests/serving/conftest.py`` also checks every response of the serving suite
(``http`` and ``oai`` fixtures) against ``/openapi.json``.
"""
