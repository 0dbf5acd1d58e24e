"""``python -m colab_resilience``: the same as the ``colab-resilience`` command."""

import sys

from .cli import main

sys.exit(main())
