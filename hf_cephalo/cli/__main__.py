"""``python -m hf_cephalo.cli``: the ``hf-cephalo`` console script (``hf_cephalo.cli.main``),
as launchers run it on every rank (``torchrun --nproc-per-node 4 -m hf_cephalo.cli profile``).

The exit status is ``main``'s: 0, 2 for bad input (``error: ...``), 1 when stdout closed early.
Everything else lives in the package (``hf_cephalo/cli/__init__.py``).
"""

import sys

from hf_cephalo.cli import main

if __name__ == "__main__":
    sys.exit(main())
