"""The report JVM's class-data archive (shoal.analytics.classarchive): where it goes, when
it is written and mapped, and that a real JVM maps what one wrote."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from shoal.analytics import classarchive
from shoal.analytics.classarchive import (
    ClassArchive,
    archive_key,
    class_archive,
    spark_jars_identity,
)
from shoal.analytics.session import find_java


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp_path), "HOME": str(tmp_path / "home"), **extra}


def test_the_first_jvm_writes_the_archive_and_the_next_maps_it(tmp_path: Path) -> None:
    java = find_java()
    env = env_for(tmp_path)
    first = class_archive(java, ["4.0", "-XX:+UseParallelGC"], env)
    assert first is not None and first.writing is not None
    assert first.path.parent == tmp_path / "shoal" / "spark-class-archive"
    assert "-XX:ArchiveClassesAtExit=" in first.java_options()
    # A real JVM writes it as it exits ...
    done = subprocess.run(
        [java, *shlex.split(first.java_options()), "-version"], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first.finish(complete=True)
    assert first.path.is_file() and not first.writing.exists()
    # ... and the next maps it: -Xshare:on refuses to start on an archive it cannot map.
    # Each use marks it used (archives a week unused are removed).
    os.utime(first.path, (1, 1))
    second = class_archive(java, ["4.0", "-XX:+UseParallelGC"], env)
    assert time.time() - first.path.stat().st_mtime < 60
    assert second == ClassArchive(first.path)
    done = subprocess.run(
        [java, "-Xshare:on", *shlex.split(second.java_options()), "-version"],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().startswith(("openjdk version", "java version"))  # no cds lines


def test_an_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    archive = class_archive(find_java(), ["x"], env_for(tmp_path))
    assert archive is not None and archive.writing is not None
    archive.writing.write_bytes(b"half an archive")
    archive.finish(complete=False)
    assert not archive.writing.exists() and not archive.path.exists()
    # Nothing written at all (the JVM died before it began): nothing to keep either.
    archive.finish(complete=True)
    assert not archive.path.exists()


def test_another_jdk_spark_or_option_gets_its_own_archive(tmp_path: Path) -> None:
    java = find_java()
    key = archive_key(java, ["4.0", "-XX:+UseParallelGC"])
    assert key == archive_key(java, ["4.0", "-XX:+UseParallelGC"])
    assert key != archive_key(java, ["4.1", "-XX:+UseParallelGC"])
    assert key != archive_key(java, ["4.0", "-XX:+UseG1GC"])
    assert key != archive_key(str(tmp_path / "jdk" / "bin" / "java"), ["4.0", "-XX:+UseParallelGC"])


@pytest.mark.parametrize("value", ["off", "0", "false", "NO", " Off "])
def test_it_can_be_turned_off(tmp_path: Path, value: str) -> None:
    assert (
        class_archive(find_java(), ["x"], env_for(tmp_path, SHOAL_SPARK_CLASS_ARCHIVE=value))
        is None
    )


def test_an_unwritable_cache_means_no_archive(tmp_path: Path) -> None:
    (tmp_path / "shoal").write_text("a file where the folder would go")
    assert class_archive(find_java(), ["x"], env_for(tmp_path)) is None


def test_old_archives_of_other_installations_and_stale_partials_are_removed(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "shoal" / "spark-class-archive"
    folder.mkdir(parents=True)
    old_other, new_other = folder / "a.jsa", folder / "b.jsa"
    old_partial, new_partial = folder / "c.jsa.1.partial", folder / "d.jsa.2.partial"
    for item in (old_other, new_other, old_partial, new_partial):
        item.write_bytes(b"x")
    long_ago = time.time() - classarchive.STALE_OTHER_SECONDS - 60
    for item in (old_other, old_partial):
        os.utime(item, (long_ago, long_ago))
    assert class_archive(find_java(), ["x"], env_for(tmp_path)) is not None
    assert sorted(p.name for p in folder.iterdir()) == ["b.jsa", "d.jsa.2.partial"]


def test_each_spark_installation_gets_its_own_archive(tmp_path: Path) -> None:
    # A JVM maps a dynamic archive only for the class path it was written with, and
    # refuses it silently otherwise: a clean clone's virtualenv, with the same pyspark
    # version as another, mapped nothing from the other's archive.
    java = find_java()
    homes = [tmp_path / "venv-a" / "pyspark", tmp_path / "venv-b" / "pyspark"]
    for home in homes:
        (home / "jars").mkdir(parents=True)
    a, b = (spark_jars_identity(str(home)) for home in homes)
    assert a != b
    assert archive_key(java, ["4.0", *a]) != archive_key(java, ["4.0", *b])
    # Reinstalled in place: the jars folder is made again.
    os.utime(homes[0] / "jars", ns=(1, 1))
    assert spark_jars_identity(str(homes[0])) != a
