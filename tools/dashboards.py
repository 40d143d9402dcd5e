"""``python -m tools.dashboards --write-repo ROOT``: rewrite a source checkout's generated
files (dashboards/*.json, deploy/kubernetes/dashboards-configmap.yaml and prometheusrule.yaml)
after a change to the boards or the rules; ``--check ROOT`` only says whether they are current.

A developer command, outside the installed package: ROOT is always given (``make dashboards`` passes the repository root), so
it never writes next to an installed package. Users export boards with
``ddpmon dashboards export [DIR]``. Exit codes: 0 done or current, 1 stale files, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpmon.dashboards import stale_files, write_generated


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.dashboards",
        description="Rewrite (or check) the generated dashboards and Kubernetes manifests of a "
        "ddpmon source checkout. To write the boards anywhere else: "
        "`ddpmon dashboards export [DIR]`.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--write-repo", metavar="ROOT", help="rewrite the generated files under ROOT"
    )
    action.add_argument(
        "--check", metavar="ROOT", help="exit 1 when a generated file under ROOT is stale"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    try:
        if args.check is not None:
            stale = stale_files(args.check)
            for path in stale:
                print(f"stale: {path}")
            if stale:
                print(
                    f"regenerate: python -m tools.dashboards --write-repo {args.check}",
                    file=sys.stderr,
                )
            return 1 if stale else 0
        for path in write_generated(args.write_repo):
            print(path)
    except ValueError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"{parser.prog}: cannot write {exc.filename or ''}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
