"""``python -m cosine_ray.cli``: the same as the ``cosine-ray`` command."""

import sys

from cosine_ray.cli import main

sys.exit(main())
