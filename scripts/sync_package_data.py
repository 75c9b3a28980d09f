"""Copies the data files the tools read by default into the package, so that an
installed wheel has them: docs/results/micro.json (the encode/decode costs
``hvd-compress advise`` uses) -> hvd_compress/tools/data/micro.json.

docs/results is the source of truth (``hvd-compress bench micro`` writes it);
run this after re-measuring.  tests/unit/test_packaging.py fails while the two
differ.

    .venv/bin/python scripts/sync_package_data.py [--check]
"""
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
#: (source of truth, packaged copy), relative to the checkout
PACKAGED = [("docs/results/micro.json", "hvd_compress/tools/data/micro.json")]


def stale():
    """The packaged copies that differ from their source."""
    return [(src, dst) for src, dst in PACKAGED
            if not (REPO / dst).exists() or (REPO / src).read_bytes() != (REPO / dst).read_bytes()]


def main(argv):
    if "--check" in argv:
        out = stale()
        for src, dst in out:
            print(f"{dst} differs from {src}: run scripts/sync_package_data.py", file=sys.stderr)
        return 1 if out else 0
    for src, dst in PACKAGED:
        (REPO / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / src, REPO / dst)
        print(f"copied {src} -> {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
