"""Build the compiled CPU kernels now: `python -m k3.ops.build [--allow-missing]` (`make` runs it while installing).

One line per kernel. Where a kernel cannot be built, the compiler's report follows and the exit status is 1: the
README promises these kernels, so a broken compiler must not pass silently into slower runs and skipped tests.
`--allow-missing` (or `K3_KERNELS=optional` in the environment, as `make KERNELS=optional` sets) accepts the torch
ops in their place: the exit status is 0 and each missing kernel gets one line saying why.
"""

import argparse
import os
import sys

from k3.ops import compiled

OPTIONAL_ENV = "K3_KERNELS"  # "optional": the torch ops may serve where a kernel cannot be built


def kernels_optional() -> bool:
    return os.environ.get(OPTIONAL_ENV, "").strip().lower() == "optional"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--allow-missing", action="store_true",
                        help=f"exit 0 where a kernel cannot be built (also {OPTIONAL_ENV}=optional)")
    allow = parser.parse_args(argv).allow_missing or kernels_optional()
    missing = []
    for name in compiled.KERNELS:
        module, why = compiled.build(name)
        if module is not None:
            print(f"k3: compiled {name} kernel ready")
            continue
        missing.append(name)
        if allow:
            print(f"k3: compiled {name} kernel unavailable, the torch ops serve ({compiled.summary(why)})")
        else:
            print(f"k3: compiled {name} kernel FAILED to build:\n{why}", file=sys.stderr)
    if missing and not allow:
        print(f"k3: {len(missing)} of {len(compiled.KERNELS)} compiled kernels could not be built "
              f"({', '.join(missing)}); fix the C++ compiler (the report above), or accept the slower torch ops with "
              f"`python -m k3.ops.build --allow-missing` (make KERNELS=optional)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
