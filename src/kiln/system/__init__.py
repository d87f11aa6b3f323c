"""kiln.system: process, file-system and environment tools every layer above may use.

Neutral: nothing here knows about engines, adapters, teachers or training. It holds child
process supervision (:mod:`~kiln.system.supervise`), owner-only directories
(:mod:`~kiln.system.private_dirs`), exact file hashing under read limits
(:mod:`~kiln.system.provenance_io`), verified model-directory snapshots
(:mod:`~kiln.system.snapshot`), the rank-population rules of a multi-process world
(:mod:`~kiln.system.ranks`) and secrets named by environment variable
(:mod:`~kiln.system.credentials`). Standard library (and pydantic for the rank documents) only.
"""
