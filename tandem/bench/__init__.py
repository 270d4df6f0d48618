"""``tandem bench``: serving benchmarks.

``serve`` load-tests a running server (``serve.py``); ``compare`` starts
Tandem disaggregated, Tandem colocated and a Hugging Face baseline in turn
and compares them (``compare.py``). Request streams come from
``datasets.py`` and ``arrivals.py``, clients from ``clients.py``, the
numbers from ``metrics.py`` (pure functions over recorded timings) and the
tables, JSON and plots from ``report.py``.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tandem.bench import compare, serve

    p = sub.add_parser("bench", help="serving benchmarks: serve (load-test a server), "
                                     "compare (Tandem vs a Hugging Face baseline)",
                       description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    serve.add_parser(commands)
    compare.add_parser(commands)
