"""C sources built on the host that runs them: the CPU decode-attention kernel
(attention/cpu_kernels/) and the small ops (kernels/c_sources/).

Built for the machine (-march=native) on first use and cached, keyed by the
source and the local headers it includes (``#include "x.h"``, beside it), the
flags, the compiler's version and the CPU's feature flags, so a build never
runs on a CPU it was not made for. OpenMP builds (-fopenmp) run in torch's own
pool: their libgomp.so.1 resolves to the copy torch already
loaded (``loaded_libgomp`` checks that there is one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

logger = structlog.get_logger(__name__)

# -fopenmp-simd vectorises the marked loops (reductions included) without an
# OpenMP runtime; OPENMP_FLAG adds the threads. -fno-trapping-math lets GCC
# turn a float clamp (x < a ? a : x) into a blend: without it the SiLU loop
# (exp_f32's clamp) stayed scalar, "control flow in loop". No value changes:
# nothing here traps on floating-point exceptions, and no reassociation.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
)
OPENMP_FLAG = "-fopenmp"
LIBS = ("-lm",)


def cache_dir() -> Path:
    """Where built kernels are kept (under $XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def torch_uses_openmp() -> bool:
    """Whether torch's intra-op threads are an OpenMP (libgomp) pool."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def loaded_libgomp() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (one: torch's)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return {line.split()[-1] for line in f if "libgomp" in line.split()[-1]}
    except OSError:
        return set()


def one_openmp_runtime(what: str) -> bool:
    """Whether at most one OpenMP runtime is loaded (after loading an OpenMP
    build): a second one would run its own pool beside torch's. Warns if not."""
    runtimes = loaded_libgomp()
    if len(runtimes) <= 1:
        return True
    logger.warning(f"{what}: a second OpenMP runtime was loaded", libgomp=sorted(runtimes))
    return False


def _local_includes(source: Path, seen: set[Path] | None = None) -> list[Path]:
    """The headers ``source`` includes by quoted name (beside it), and theirs,
    in include order, each once."""
    seen = set() if seen is None else seen
    found = []
    for line in source.read_text(encoding="utf-8").splitlines():
        words = line.strip().split()
        if len(words) >= 2 and words[0] == "#include" and words[1].startswith('"'):
            header = (source.parent / words[1].strip('"')).resolve()
            if header not in seen:
                seen.add(header)
                found += [header, *_local_includes(header, seen)]
    return found


def source_bytes(source: Path) -> bytes:
    """What a build's key hashes of the sources: the file and its local headers."""
    return b"".join(p.read_bytes() for p in [source, *_local_includes(source)])


def build_library(source: Path, flags: list[str], stem: str, directory: Path | None = None) -> Path:
    """Compile ``source`` with ``flags`` (or find it built) into
    ``<directory>/<stem>-<key>.so``; raises RuntimeError when there is no
    compiler or the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler ($CC, cc or gcc) found")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256(
        source_bytes(source)
        + " ".join(flags).encode()
        + version.stdout.encode()
        + _cpu_identity().encode()
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build to a private name, then rename: workers starting together may
    # build at once, and none may load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    done = subprocess.run(
        [cc, *flags, "-o", tmp, str(source), *LIBS], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source.name} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)
    return target


def build_threaded(
    source: Path, flags: list[str], stem: str, directory: Path | None = None
) -> Path:
    """``build_library`` with OpenMP where torch's pool is OpenMP and the
    OpenMP build succeeds (a compiler without libgomp's development files
    fails it), else without: one thread then. Raises as build_library."""
    if torch_uses_openmp():
        try:
            return build_library(source, [*flags, OPENMP_FLAG], stem + "-omp", directory)
        except RuntimeError as e:
            logger.warning(
                "OpenMP build failed; building without threads",
                source=source.name,
                error=str(e)[-300:],
            )
    return build_library(source, flags, stem, directory)
