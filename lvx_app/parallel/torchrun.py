"""`python -m lvx_app.parallel.torchrun ARGS`: torch's torchrun (same arguments) that ends a failed group quietly.

torchrun ends a failed group with a Python traceback (ChildFailedError), a summary block and error log lines.
Ranks run through `lvx_app.parallel.group.run_rank` already print one readable line saying why they failed, so that
noise only buries the cause. This runs the same launcher, `torch.distributed.run.run`, and prints a line only
for a rank that could not say why: one killed by a signal (the out-of-memory killer, most often).
Exit codes: 0 when every rank succeeded, 1 when one failed, 130 when stopped by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: Optional[list[str]] = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            if failure.exitcode < 0:
                print(f"rank {rank} was killed by {failure.signal_name()} without a message (out of memory? "
                      "check dmesg)", file=sys.stderr)
        return 1
    except SignalException:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
