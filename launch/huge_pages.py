"""glibc's malloc asked for transparent huge pages in the ranks that `spmd run` starts.

Why: XLA's CPU runtime allocates each execution's temporary buffer afresh, one block of tens
to hundreds of MB for a mid-sized model. glibc maps every block over 32 MiB with mmap and
unmaps it when it is freed (its threshold cannot be raised past that), so at every step the
kernel zeroes the block's pages and faults them in again, 4 KiB at a time. With
`glibc.malloc.hugetlb=1` (glibc 2.35 and later) malloc asks the kernel for transparent huge
pages for its blocks (`madvise`), which it then faults in 2 MiB at a time where THP is
`madvise` or `always` (/sys/kernel/mm/transparent_hugepage/enabled). The README's main job on
2 cores: 12.0 M -> 0.45 M minor page faults, 54 -> 25 s of system time, 190 -> 150 s of CPU,
the same numbers (benchmarks/results/LOG.md, 2026-11-30). An older glibc ignores the
tunable, and a kernel with THP `never` ignores the advice.

Invariants
- A GLIBC_TUNABLES of the user's that names glibc.malloc.hugetlb is never changed; the
  user's other tunables are kept, this one appended (`name=value` pairs joined by `:`).
- `launch.malloc_huge_pages: false` leaves the environment as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

TUNABLES_VAR = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"
HUGE_PAGES = f"{HUGETLB}=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def with_huge_pages(environ: Mapping[str, str], enabled: bool = True) -> dict[str, str]:
    """`environ` with glibc.malloc.hugetlb=1 in GLIBC_TUNABLES (module doc), for the ranks."""
    env = dict(environ)
    current = env.get(TUNABLES_VAR, "").strip(":")
    if not enabled or any(pair.split("=")[0] == HUGETLB for pair in current.split(":")):
        return env
    env[TUNABLES_VAR] = f"{current}:{HUGE_PAGES}" if current else HUGE_PAGES
    return env


def malloc_report(environ: Mapping[str, str]) -> dict[str, str | None]:
    """What `spmd doctor` shows: this process's GLIBC_TUNABLES and the kernel's THP mode."""
    try:
        text = THP_MODE.read_text()
        mode = text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        mode = None
    return {"glibc_tunables": environ.get(TUNABLES_VAR) or None, "transparent_hugepage": mode}
