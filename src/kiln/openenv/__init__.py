"""OpenEnv: discovery of an environment server, WebSocket episodes, rollout groups -> GRPO admission.

``discovery`` fetches and hashes an environment's identity and compiles its action schema;
``episode`` drives one lock-step ``/ws`` session per candidate; ``service`` owns the
server-side runs (admission, persistence under ``<adapters>/.openenv/runs``, execution).
Nothing here imports :mod:`kiln.serving` (tests/test_layering.py).
"""
