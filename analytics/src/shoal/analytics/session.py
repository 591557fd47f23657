"""The Spark session of the report: local by default, any master by flag, or spark-submit's.

Before starting a JVM we check for Java ourselves, so a missing runtime is one clear line
instead of a Py4J stack trace. Under ``spark-submit`` (which sets ``PYSPARK_GATEWAY_PORT``)
the JVM already runs with the master and options given there; nothing is overridden.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.analytics.classarchive import ClassArchive, class_archive, spark_jars_identity

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DEFAULT_MASTER",
    "JavaMissing",
    "class_archive_state",
    "default_driver_memory",
    "driver_memory_mib",
    "find_java",
    "machine_memory",
    "spark_session",
    "stop_spark",
    "under_spark_submit",
]

log = logging.getLogger(__name__)

DEFAULT_MASTER = "local[*]"
MIN_JAVA = 17
# The report's JVM allocates much and briefly (parsed lines, exploded rows): the throughput
# collector beats the default G1 there (10M rows of the bench, parse and pairing: 15.0 s
# -> 12.4 s on local[2], 17.0 s -> 14.9 s on local[1]). Batch work: its pauses do not matter.
JVM_OPTIONS = "-XX:+UseParallelGC"
# Compiled classes Spark keeps for reuse: a report makes some 230 (Janino, 2M rows).
CODEGEN_CACHE_ENTRIES = 1000
# The driver's heap when nobody says (--driver-memory): a quarter of the machine's memory,
# as the JVM itself takes by default (Spark's own default, 1g, replaces that). The report
# keeps its checkpoints in the heap, about 1 GB live at 10M rows: a 2g heap, full of them,
# ran 350-386 collections (44-50 full) and 10 s of collector CPU where 6g ran 86-112 (14-16
# full) and 3-4 s: 63.8 s against 53.8 s for the report (issue 30). At least 1g (Spark's
# default), at most 8g: more than a one-machine report needs, the rest left to the Python
# side (pandas, the plots) and to other work.
DRIVER_MEMORY_SHARE = 0.25
DRIVER_MEMORY_MIN_MIB = 1024
DRIVER_MEMORY_MAX_MIB = 8192
# Spark refuses a heap under 450 MiB (its 300 MiB reserve x 1.5); -Xmx512m gives 455 MiB.
DRIVER_MEMORY_FLOOR_MIB = 512
_UNITS = {"m": 1, "g": 1024, "t": 1024 * 1024}
# The class-data archive of the JVM this process started (classarchive): stop_spark puts
# one it wrote in place once the JVM has exited.
_archive: ClassArchive | None = None
# How much longer a JVM that writes its class-data archive may take to exit (10-20 s on 2
# slow cores).
ARCHIVE_WRITE_SECONDS = 120.0


class JavaMissing(RuntimeError):
    """No usable Java runtime for Spark (the message is one line, meant for the user)."""


def under_spark_submit() -> bool:
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT"))


def _java_major(java: str) -> int | None:
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def find_java(env: Mapping[str, str] | None = None) -> str:
    """The java executable Spark will use ($JAVA_HOME/bin/java, else java on PATH)."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not os.access(java, os.X_OK):
            raise JavaMissing(
                f"JAVA_HOME={home} has no bin/java: point it at a Java {MIN_JAVA}+ runtime "
                "or unset it to use java from PATH"
            )
    else:
        found = shutil.which("java", path=env.get("PATH"))
        if found is None:
            raise JavaMissing(
                f"no Java runtime: the report runs on Spark, which needs Java {MIN_JAVA}+ "
                "(install e.g. openjdk-17-jre-headless, or set JAVA_HOME)"
            )
        java = found
    major = _java_major(java)
    if major is None:
        raise JavaMissing(f"{java} does not run or does not say its version (java -version)")
    if major < MIN_JAVA:
        raise JavaMissing(f"{java} is Java {major}; Spark 4 needs Java {MIN_JAVA} or newer")
    return java


def driver_memory_mib(value: str) -> int:
    """MiB in a memory size as the driver's JVM takes it (``-Xmx``): a whole number and m, g
    or t (``512m``, ``4g``); ValueError, said for the user, if it is not one or is too
    small for Spark. (A bare number would be bytes to the JVM, and "4gb" no size at all.)"""
    match = re.fullmatch(r"(\d+)([mgt])", value.strip(), re.IGNORECASE)
    if not match:
        raise ValueError(f"{value!r} is not a memory size: a whole number and m, g or t (4g)")
    mib = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if mib < DRIVER_MEMORY_FLOOR_MIB:
        raise ValueError(
            f"{value} is too little: Spark's driver needs at least {DRIVER_MEMORY_FLOOR_MIB}m"
        )
    return mib


def _cgroup_limit(root: Path) -> int | None:
    """This process's memory limit from its cgroup (v2, else v1), if it has one."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        # "max" (v2) or a huge number (v1, no limit): the machine's memory decides.
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def machine_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or its
    container's limit if lower (as the JVM counts it); None if unknown."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        physical = 0
    limit = _cgroup_limit(cgroup_root)
    known = [n for n in (physical, limit) if n and n > 0]
    return min(known) if known else None


def default_driver_memory(total: int | None = None) -> str:
    """The driver's memory when nobody says: DRIVER_MEMORY_SHARE of ``total`` bytes
    (default: :func:`machine_memory`) in MiB, within DRIVER_MEMORY_MIN_MIB and
    DRIVER_MEMORY_MAX_MIB; the minimum if the memory is unknown."""
    total = machine_memory() if total is None else total
    share = int((total or 0) * DRIVER_MEMORY_SHARE) // (1024 * 1024)
    return f"{min(max(share, DRIVER_MEMORY_MIN_MIB), DRIVER_MEMORY_MAX_MIB)}m"


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "shoal-analytics",
    driver_memory: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for the report: ``master`` (default ``local[*]``) unless running under
    spark-submit, UTC, no UI, Arrow transfers, this Python for the workers; ``driver_memory``
    by default :func:`default_driver_memory`."""
    global _archive
    submitted = under_spark_submit()
    java_options = JVM_OPTIONS
    if not submitted:
        java = find_java()
        import pyspark

        _archive = class_archive(
            java,
            [
                pyspark.__version__,
                *spark_jars_identity(
                    os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
                ),
                JVM_OPTIONS,
                repr(sorted((conf or {}).items())),
            ],
        )
        if _archive is not None:
            java_options = f"{JVM_OPTIONS} {_archive.java_options()}"
        # Python workers: this interpreter (not whatever "python3" is on PATH), without the
        # working directory on sys.path (a folder named "operator" in it would shadow the
        # standard library's operator module, as in this repository).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ["PYTHONSAFEPATH"] = "1"
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    settings: dict[str, str] = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.executorEnv.PYTHONSAFEPATH": "1",
        "spark.ui.showConsoleProgress": "false",
        # Standard Parquet timestamps (not the legacy INT96) for readers other than Spark.
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    }
    if not submitted:
        chosen = master or DEFAULT_MASTER
        builder = builder.master(chosen)
        scratch = tempfile.gettempdir()
        settings.update(
            {
                "spark.driver.memory": driver_memory or default_driver_memory(),
                "spark.ui.enabled": "false",
                # Keep spark-warehouse / metastore files out of the working directory.
                "spark.sql.warehouse.dir": os.path.join(scratch, "shoal-spark-warehouse"),
                "spark.driver.extraJavaOptions": f"-Dderby.system.home={scratch} {java_options}",
                # A cluster's executors (local masters run the tasks in the driver's JVM).
                "spark.executor.extraJavaOptions": JVM_OPTIONS,
                # Spark keeps 100 compiled classes; a report compiles some 230, so a second
                # report on the same session compiled them all again (and the JIT compiled
                # the new classes again): 2M rows warm 16.4 s -> 13.7 s.
                "spark.sql.codegen.cache.maxEntries": str(CODEGEN_CACHE_ENTRIES),
            }
        )
        if chosen.startswith("local"):
            # The default 200 shuffle partitions are for clusters; a few per core do here.
            settings["spark.sql.shuffle.partitions"] = str(4 * (os.cpu_count() or 2))
    elif master:
        log.warning("--master %s ignored: spark-submit decides the master", master)
    for key, value in {**settings, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    log.info("Spark %s, master %s", spark.version, spark.sparkContext.master)
    return spark


def class_archive_state() -> str:
    """What the JVM this process started does with its class-data archive (classarchive):
    "mapped", "writing" (as it exits), or "none" (turned off, under spark-submit, or no
    JVM started)."""
    if _archive is None:
        return "none"
    return "writing" if _archive.writing is not None else "mapped"


def stop_spark(spark: SparkSession, timeout: float = 30.0) -> None:
    """Stop the session and, unless under spark-submit, the JVM pyspark started for it
    (it would otherwise live until this Python process exits)."""
    from pyspark import SparkContext

    global _archive
    gateway = SparkContext._gateway
    spark.stop()
    if gateway is None or under_spark_submit():
        return
    archive, _archive = _archive, None
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    try:
        gateway.shutdown()
    except Exception as exc:  # already gone
        log.debug("Gateway shutdown: %r", exc)
    # Class attributes: the next session launches a new JVM.
    setattr(SparkContext, "_gateway", None)  # noqa: B010
    setattr(SparkContext, "_jvm", None)  # noqa: B010
    if proc is None:
        return
    if proc.stdin is not None:
        proc.stdin.close()  # the JVM exits when its stdin closes
    if archive is not None and archive.writing is not None:
        timeout += ARCHIVE_WRITE_SECONDS  # it writes the archive as it exits
    try:
        proc.wait(timeout)
        exited = True
    except subprocess.TimeoutExpired:
        exited = False
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if archive is not None:
        archive.finish(complete=exited)
