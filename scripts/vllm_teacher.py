#!/usr/bin/env python3
"""Launch vLLM as an identity-bound Kiln teacher (see docs/teachers.md).

Run it with the vLLM environment's own python; Kiln need not be installed there:
this wrapper puts the checkout's ``src`` directory on ``sys.path`` and hands over
to ``kiln.teachers.launcher``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from kiln.teachers.launcher import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
