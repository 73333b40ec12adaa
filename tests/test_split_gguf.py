"""Embedded GGUF files shipped as data-only part packages: found without running their code, checked
(count, size, GGUF magic, sha256) and assembled once, with a sha256 beside the file.

The checks run on small part packages this test writes (a folder on sys.path, as pip lays one out);
the last test resolves the real Qwen2.5-Coder pair's ids to their assembled files."""
import hashlib
import sys
from pathlib import Path

import pytest

from engine.models.split_gguf import QWEN25_CODER_05B, QWEN25_CODER_15B, SplitGguf


def lay_out(site: Path, prefix: str, parts: list[bytes], poison: bool = True) -> None:
    """Part packages as pip installs them: `<prefix>i/__init__.py` and `<prefix>i/data/partNN.bin`. Each
    __init__ raises: assembling must never import a part."""
    for i, data in enumerate(parts, 1):
        package = site / f"{prefix.replace('-', '_')}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('a part package was imported')\n" if poison else "")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def split(prefix: str, parts: list[bytes], **over) -> SplitGguf:
    whole = b"".join(parts)
    fields = dict(file_name="tiny.gguf", package_prefix=prefix, version="1.0", parts=len(parts), size=len(whole),
                  sha256=hashlib.sha256(whole).hexdigest())
    return SplitGguf(**{**fields, **over})


PARTS = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail"]


def test_assembles_once_with_a_sidecar(site, tmp_path):
    lay_out(site, "tiny-part", PARTS)
    model = split("tiny-part", PARTS)
    out = model.assemble(tmp_path / "cache")
    assert out.read_bytes() == b"".join(PARTS)
    assert (out.parent / "tiny.gguf.sha256").read_text().split()[0] == model.sha256
    assert not any(m.startswith("tiny_part") for m in sys.modules), "a part package was imported"
    mtime = out.stat().st_mtime_ns
    assert model.assemble(tmp_path / "cache") == out and out.stat().st_mtime_ns == mtime  # not rewritten
    assert model.package_names() == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]


def test_a_wrong_file_in_the_cache_is_replaced(site, tmp_path):
    lay_out(site, "tiny-part", PARTS)
    model = split("tiny-part", PARTS)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tiny.gguf").write_bytes(b"GGUF truncated")  # an interrupted copy, no sidecar
    assert model.assemble(tmp_path / "cache").read_bytes() == b"".join(PARTS)


@pytest.mark.parametrize("case, message", [
    ("missing", "package tiny-part3 is not installed"),
    ("size", "hold 235 bytes, not 236"),
    ("magic", "does not start a GGUF file"),
    ("sha256", "sha256 is"),
])
def test_bad_parts_are_refused_and_nothing_is_left(site, tmp_path, case, message):
    parts = list(PARTS)
    model = split("tiny-part", parts)
    if case == "missing":
        parts = parts[:2]
    elif case == "size":
        parts[2] = parts[2][:-1]
    elif case == "magic":
        parts[0] = b"GGUG" + parts[0][4:]
    elif case == "sha256":
        parts[1] = bytes(reversed(parts[1]))
    lay_out(site, "tiny-part", parts)
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        model.assemble(tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())  # no partial file


def test_the_qwen_pair_resolves_to_its_assembled_files():
    """The real packages (set-up installs them): both ids give the checked files, one tokenizer."""
    from engine.models.loading import load_tokenizer, resolve_model

    for name, model in [("Qwen/Qwen2.5-Coder-1.5B-Instruct", QWEN25_CODER_15B),
                        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", QWEN25_CODER_05B)]:
        source = resolve_model(name)
        assert source.kind == "gguf" and Path(source.path).name == model.file_name
        assert model.is_assembled(Path(source.path))
    target = load_tokenizer(resolve_model("Qwen/Qwen2.5-Coder-1.5B-Instruct"))
    draft = load_tokenizer(resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct"))
    assert target.get_vocab() == draft.get_vocab()
    assert "tools" in target.chat_template  # Qwen's own template, which renders tools
