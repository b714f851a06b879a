"""`phasekv demo`: a compressed cache beside a full one."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show a compressed cache next to a full one")
    p.add_argument("--tokens", type=int, default=4096)
    p.set_defaults(func=run)


def run(args) -> None:
    from phasekv.demo import run_demo

    run_demo(args.tokens)
