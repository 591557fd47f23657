"""A class-data archive for the report's JVM: its start in half the time, after the first.

Each report starts a JVM that loads some 15,000 classes (Spark, Scala, Hadoop, Parquet,
Arrow) from a few hundred jars, verifying and parsing each: most of the 6-8 s before the
session answers, and more during the first query. Java's class-data sharing (CDS) keeps
them parsed and verified in an archive that the next JVM maps instead (JDK 13+'s dynamic
archive: `-XX:ArchiveClassesAtExit` writes it as the JVM exits, `-XX:SharedArchiveFile`
uses it). On the 2-core machine of issue 30 a session's start went from 6.2-8.3 s to
3.1-3.9 s, and its first query from 3.6-4.3 s to 2.3-2.6 s.

The first report of an installation writes the archive as its JVM exits (10-18 s, once;
the report says so), under the user's cache directory (``$XDG_CACHE_HOME/shoal`` or
``~/.cache/shoal``, 150-250 MB, removed after a week unused), named after what it
depends on: the JDK's runtime image, pyspark's version, the JVM options, and where Spark's
jars are (a JVM maps an archive only for the class path it was written with, so each
virtualenv writes its own). A JVM that cannot use an archive ignores it and runs as
without; the archive's own log lines are turned off. ``SHOAL_SPARK_CLASS_ARCHIVE=off``
turns it off; the report under ``spark-submit`` never uses one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SHOAL_SPARK_CLASS_ARCHIVE"
SUFFIX = ".jsa"
# A half-written archive (its JVM was killed) is removed once it is this old.
STALE_PARTIAL_SECONDS = 3600.0
# Another installation's archive (another virtualenv, a JDK or Spark upgrade) is removed
# once it was not used for this long (each use touches it); one still in use after all is
# written again.
STALE_OTHER_SECONDS = 7 * 86400.0
# The archive's warnings (classes it skips, one it cannot map) say nothing to a user.
QUIET = "-Xlog:cds=off,cds+dynamic=off"


@dataclass(frozen=True)
class ClassArchive:
    """The archive a JVM maps (`writing` None), or writes as it exits (`writing`: where,
    moved to `path` by finish())."""

    path: Path
    writing: Path | None = None

    def java_options(self) -> str:
        if self.writing is not None:
            return f"{QUIET} -XX:ArchiveClassesAtExit={self.writing}"
        return f"{QUIET} -XX:SharedArchiveFile={self.path}"

    def finish(self, complete: bool = True) -> None:
        """After the JVM exited (`complete`: by itself, not stopped by us halfway through
        writing): put a written archive in place (atomically: a report starting meanwhile
        maps the whole archive or none), or remove what it wrote."""
        if self.writing is None:
            return
        try:
            if complete and self.writing.stat().st_size > 0:
                os.replace(self.writing, self.path)
                log.info(
                    "Wrote the JVM's class-data archive %s: later reports start faster", self.path
                )
                return
        except OSError as exc:
            log.warning("Could not keep the JVM's class-data archive (%s)", exc)
        self.writing.unlink(missing_ok=True)


def cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shoal" / "spark-class-archive"


def archive_key(java: str, parts: Iterable[str]) -> str:
    """What an archive depends on: the JDK (its runtime image, `lib/modules`, which every
    JDK update rewrites) and `parts` (pyspark's version, spark_jars_identity, the JVM
    options and conf)."""
    digest = hashlib.sha256()
    real = Path(os.path.realpath(java))
    modules = real.parent.parent / "lib" / "modules"
    try:
        stat = modules.stat()
        digest.update(f"{modules}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    except OSError:
        digest.update(str(real).encode())
    for part in parts:
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:20]


def spark_jars_identity(spark_home: str) -> list[str]:
    """What a JVM checks an archive's class path against, for archive_key: where Spark's
    jars are (an archive written by an installation elsewhere, another virtualenv, is
    refused, silently) and when that folder last changed (a reinstall in place)."""
    jars = os.path.join(spark_home, "jars")
    try:
        changed = str(os.stat(jars).st_mtime_ns)
    except OSError:
        changed = "?"
    return [os.path.realpath(jars), changed]


def class_archive(
    java: str, parts: Iterable[str], env: Mapping[str, str] | None = None
) -> ClassArchive | None:
    """The archive for this JVM: the one to map if it was written, else one to write;
    None when turned off or the cache directory cannot be written."""
    env = os.environ if env is None else env
    if env.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return None
    folder = cache_dir(env)
    path = folder / f"{archive_key(java, parts)}{SUFFIX}"
    if path.is_file():
        try:
            os.utime(path)  # in use: not removed as another installation's (_forget_others)
        except OSError:
            pass
        return ClassArchive(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _forget_others(folder, keep=path)
    except OSError as exc:
        log.info("No class-data archive for the JVM (%s): it starts as usual", exc)
        return None
    log.info(
        "The JVM writes a class-data archive as it exits (once, some 10 s): later reports "
        "start faster (%s; %s=off turns it off)",
        path,
        ENV,
    )
    return ClassArchive(path, writing=path.with_name(f"{path.name}.{os.getpid()}.partial"))


def _forget_others(folder: Path, keep: Path) -> None:
    """Remove old archives of another JDK or Spark, and old partial ones."""
    now = time.time()
    for item in folder.iterdir():
        age = now - item.stat().st_mtime
        if item != keep and (
            (item.suffix == SUFFIX and age > STALE_OTHER_SECONDS)
            or (item.name.endswith(".partial") and age > STALE_PARTIAL_SECONDS)
        ):
            item.unlink(missing_ok=True)
