"""``python -m runtime.probe worker ...`` (one rank of the collective probe, started by torchrun)
and ``python -m runtime.probe ops CONFIG_JSON OUT`` (one copy of the operator profile)."""

import sys

from .collectives import worker_main
from .inprocess import ops_main

if len(sys.argv) == 4 and sys.argv[1] == "ops":
    ops_main(sys.argv[2], sys.argv[3])
elif len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2:])
else:
    print("usage: python -m runtime.probe worker --out DIR --sizes N,N,... (started by torchrun; "
          "use `k3sched probe` instead)", file=sys.stderr)
    sys.exit(2)
