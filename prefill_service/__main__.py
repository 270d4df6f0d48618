"""python -m prefill_service --model ... --port ... [--transport mooncake,grpc]"""

from __future__ import annotations

from prefill_service.worker import PrefillWorker
from worker.main import run

DESCRIPTION = "Tandem prefill worker"
ROLES = ["prefill"]


def main(argv: list[str] | None = None) -> None:
    # The torch transport's store listens on --host; peers reach it at the
    # advertised host.
    run(lambda aengine, wid, addr, args, **kw: PrefillWorker(
            aengine, wid, addr, host=args.advertise_host or args.host, bind_host=args.host, **kw),
        DESCRIPTION, ROLES, argv)


if __name__ == "__main__":
    main()
