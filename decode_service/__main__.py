"""python -m decode_service --model ... --port ... [--role decode|both]"""

from __future__ import annotations

from decode_service.worker import DecodeWorker
from worker.main import run

DESCRIPTION = "Tandem decode worker"
ROLES = ["decode", "both"]  # the first is the default --role


def main(argv: list[str] | None = None) -> None:
    run(lambda aengine, wid, addr, args, **kw: DecodeWorker(aengine, wid, addr, role=args.role,
                                                           **kw),
        DESCRIPTION, ROLES, argv)


if __name__ == "__main__":
    main()
