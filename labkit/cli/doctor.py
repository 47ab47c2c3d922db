"""``labkit doctor``: what this machine has and lacks for the lab, each check with its fix."""

from __future__ import annotations

import json
from dataclasses import asdict

from labkit import doctor


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine for the lab; exits 1 on a failure")
    p.add_argument("--no-server", action="store_true", help="do not start a Triton server")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(handler=_cli)


def _cli(args) -> int:
    checks = doctor.run_checks(server=not args.no_server)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(doctor.format_table(checks))
        counts = {s: sum(c.status == s for c in checks) for s in doctor.STATUSES}
        print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return doctor.exit_code(checks)
