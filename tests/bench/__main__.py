"""`make bench`: runs every `tests/bench/bench_*.py` module's `main()`, each printing its figures.

`python -m tests.bench [NAME ...]` runs only the named benchmarks (e.g. `rollout postrender`).
"""

import importlib
import pkgutil
import sys
import time

import tests.bench as package


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("bench_"))
    if argv:
        names = [n for n in names if n.removeprefix("bench_") in argv or n in argv]
    for name in names:
        print(f"\n### {name.removeprefix('bench_')}", flush=True)
        started = time.perf_counter()
        importlib.import_module(f"tests.bench.{name}").main()
        print(f"({name} took {time.perf_counter() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
