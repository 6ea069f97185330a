"""torchrun, reporting failures the titanlite way (used by run_train.sh).

`python -m titanlite.launch [torchrun args] -m titanlite.train [train args]`

Workers print their own one-line error (exit 2: bad input, 3: the run was stopped); torchrun's
multi-screen failure summary would bury it, so it is replaced by the workers' exit code, plus
one line naming the rank when a worker crashed for another reason (its traceback is above).
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: list[str]) -> int:
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        if first.exitcode in (2, 3):
            return first.exitcode
        print(
            f"titanlite: rank {rank} failed (exit code {first.exitcode}); see its output above",
            file=sys.stderr,
        )
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
