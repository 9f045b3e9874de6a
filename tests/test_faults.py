"""Conversion fault paths (issue 16, finding 6): a process killed between steps (really killed:
os._exit in a child process, so no cleanup runs), a full disk, a read-only destination. Each
leaves the previous bundle intact, says what happened, and the next run cleans up."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny import perturbed_copy, write_model

from ondevice.convert import bundle as cb
from ondevice.convert import cli
from ondevice.errors import BundleError
from ondevice.models.bundle import is_bundle

CONTEXT, CHUNK = 64, 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    verifier = write_model(root / "verifier", seed=0)
    return verifier, perturbed_copy(verifier, root / "draft", noise=0.1)


def _convert(pair: tuple[Path, Path], out: Path, *extra: str) -> int:
    return cli.main(
        ["--verifier", str(pair[0]), "--draft", str(pair[1]), "-o", str(out),
         "--context", str(CONTEXT), "--draft-chunk", str(CHUNK), *extra]
    )  # fmt: skip


def _around(out: Path) -> list[str]:
    """Names next to `out` that belong to it: itself and its hidden directories."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.lstrip(".").startswith(out.name))


def _old_bundle(out: Path) -> Path:
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    (out / "which").write_text("old")
    return out


def _die_in_child(out: Path, when: str) -> None:
    """Run a --force replacement of `out` in a child process that dies (os._exit: no finally,
    no cleanup) at the point `when`."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        import ondevice.convert.bundle as cb

        out, when = Path({str(out)!r}), {when!r}
        real_exchange, real_rename = cb._exchange, os.rename
        def exchange(a, b):
            if when == "no-exchange-then-first-rename":
                return False
            real_exchange(a, b)
            os._exit(9)  # after the swap, before the old bundle is deleted
        def rename(a, b):
            real_rename(a, b)
            os._exit(9)  # after the first of the two renames
        with cb.staging_dir(out, force=True) as tmp:
            (tmp / "manifest.json").write_text("{{}}")
            (tmp / "which").write_text("new")
            if when == "staging":
                os._exit(9)
            cb._exchange = exchange
            os.rename = rename
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr


def test_a_killed_conversion_is_cleaned_up_by_the_next(pair, tmp_path, capsys):
    out = _old_bundle(tmp_path / "b")
    _die_in_child(out, "staging")
    left = [n for n in _around(out) if ".partial-" in n]
    assert len(left) == 1 and (out / "which").read_text() == "old"  # old bundle untouched
    # A live conversion's staging directory (this process's pid) is left alone.
    live = tmp_path / f".b.partial-{os.getpid()}-abc"
    live.mkdir()
    assert _convert(pair, out, "--force") == 0
    assert f"removed {left[0]}" in capsys.readouterr().err
    assert _around(out) == sorted(["b", live.name]) and is_bundle(out)


@pytest.mark.parametrize("when", ["exchange", "no-exchange-then-first-rename"])
def test_a_kill_during_force_leaves_a_bundle_and_is_recovered(tmp_path, when):
    out = _old_bundle(tmp_path / "b")
    _die_in_child(out, when)
    if when == "exchange":  # one atomic swap: `out` is the new bundle the moment it happens
        assert (out / "which").read_text() == "new"
    else:  # two renames (filesystems without an exchange): killed in between, out is aside
        assert not out.exists()
    done = cb.recover(out)
    assert done and _around(out) == ["b"] and is_bundle(out)
    assert (out / "which").read_text() == ("new" if when == "exchange" else "old")


def test_force_swaps_in_one_step(tmp_path, monkeypatch):
    """On Linux (renameat2) and macOS (renamex_np) --force never passes through a state
    without a bundle: the replacement needs no rename at all."""
    if not cb._exchange(_old_bundle(tmp_path / "x"), (tmp_path / "y").mkdir() or tmp_path / "y"):
        pytest.skip("this filesystem has no atomic exchange")
    out = _old_bundle(tmp_path / "b")

    def no_rename(*args):
        raise AssertionError("renamed")

    with cb.staging_dir(out, force=True) as tmp:
        (tmp / "which").write_text("new")
        monkeypatch.setattr(os, "rename", no_rename)
    assert (out / "which").read_text() == "new" and _around(out) == ["b"]


def test_a_full_disk_keeps_the_old_bundle(pair, tmp_path, monkeypatch, capsys):
    out = _old_bundle(tmp_path / "b")
    real = cli._save_mlx

    def save(loaded, path):  # the verifier fits, the draft does not
        if "draft" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))
        real(loaded, path)

    monkeypatch.setattr(cli, "_save_mlx", save)
    assert _convert(pair, out, "--force") == 1
    err = capsys.readouterr().err
    assert "error: writing the bundle" in err and "No space left on device" in err
    assert f"{out}/draft/mlx/model.safetensors" in err
    assert "Nothing was written" in err and "Free some disk space" in err and "Traceback" not in err
    assert (out / "which").read_text() == "old" and _around(out) == ["b"]


def test_too_little_space_is_refused_before_loading(pair, tmp_path, monkeypatch, capsys):
    import ondevice.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ondevice.models, "load_model", no_load)
    usage = cb.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cb.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    assert _convert(pair, tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert "GB free" in err and "needs about" in err
    assert _around(tmp_path / "b") == []


@pytest.mark.parametrize("cause", ["EROFS", "/sys"])
def test_a_read_only_destination_is_refused_before_loading(
    pair, tmp_path, monkeypatch, capsys, cause
):
    import ondevice.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ondevice.models, "load_model", no_load)
    if cause == "EROFS":
        out = tmp_path / "b"

        def mkdtemp(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(cb.tempfile, "mkdtemp", mkdtemp)
    else:  # a real filesystem this process cannot write, even as root
        out = Path("/sys/ondevice-test.bundle")
        if not Path("/sys").is_dir() or os.access("/sys", os.W_OK) and _writable("/sys"):
            pytest.skip("/sys is writable here")
    assert _convert(pair, out) == 1
    err = capsys.readouterr().err
    assert "cannot write there" in err and "Traceback" not in err
    assert not out.exists()


def _writable(folder: str) -> bool:
    try:
        os.rmdir(cb.tempfile.mkdtemp(dir=folder))
        return True
    except OSError:
        return False


def test_check_destination_messages(tmp_path):
    with pytest.raises(BundleError, match="no such directory"):
        cb.check_destination(tmp_path / "nowhere" / "b", force=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(BundleError, match="not a directory"):
        cb.check_destination(tmp_path / "f", force=True)
