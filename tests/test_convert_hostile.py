"""``convert-layout`` against hostile stores and arguments: crafted headers, links out of the
store, nested stores, shapes the model cannot take or absurdly large. Each is a one-line
refusal or a corrupt object counted and skipped — never a traceback, a hang, a huge
allocation, or a write into the source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from formats.kvobject import KVObjectCodec, parse_header
from tests.test_cli_convert import convert, files, legacy_source, objects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line_error(res, code: int, text: str) -> None:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and text in err[0], res.stderr


def recraft(path, change=None, payload_len=None) -> None:
    """Rewrite the object at ``path`` with its layout description changed by ``change`` (a
    header with valid checksums: only its meaning is hostile), or its payload length claim."""
    raw = open(path, "rb").read()
    h = parse_header(raw)
    d = json.loads(h.layout_json)
    if change:
        change(d)
    payload = raw[h.header_len:]
    codec = KVObjectCodec(d)
    head = bytearray(codec.header_for(h.page_hash, payload_len or len(payload),
                                      h.payload_checksum))
    open(path, "wb").write(bytes(head) + payload)


def obj_path(root, name):
    return os.path.join(root, "objects", name[:2], name)


@pytest.mark.parametrize("change", [
    lambda d: d.update(num_layers="4"),
    lambda d: d.update(kv_heads=[2]),
    lambda d: d.update(head_dim=None),
    lambda d: d.update(dtype=["float32"]),
    lambda d: d["store"].update(shape="2,1"),
    lambda d: d["store"].update(rank=[0, "x"]),
    lambda d: d.update(total_layers=10 ** 9),            # a model claimed huge
    lambda d: d.update(total_kv_heads=10 ** 12, total_layers=10 ** 12),
    lambda d: d.update(head_dim=10 ** 15),               # a payload claimed huge
])
def test_crafted_headers_are_corrupt_objects(tmp_path, change):
    src, _ = legacy_source(tmp_path)
    victim = objects(src)[0]
    recraft(obj_path(src, victim), change)
    res = convert(src, tmp_path / "dst", "--verify", "--format", "json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["corrupt"] == 1 and s["objects_in"] == 11 and s["written"] == 44


def file_as_its_own(root, path) -> str:
    """Move the (crafted) object at ``path`` to the key its own header names, as a store that
    holds just it would: ``convert-layout`` then takes its claims at face value."""
    from engine.storage.keys import object_key
    from engine.storage.placement import describe_object, span

    h = parse_header(open(path, "rb").read())
    region, placement, tag = describe_object(h.layout)
    model = region.whole()
    (l0, l1), (h0, h1) = span(region)
    suffix = placement.tile_at(model, placement.namespace(model, tag), (l0, l1), (h0, h1),
                               tag).suffix
    key = object_key(h.page_hash, suffix)
    os.makedirs(os.path.join(root, "objects", key[:2]), exist_ok=True)
    os.rename(path, obj_path(root, key))
    return key


@pytest.mark.parametrize("claim", [
    dict(total_layers=2 ** 40),                         # the model: ~10^12 layers
    dict(total_layers=2 ** 20, total_kv_heads=2 ** 20),
    dict(head_dim=2 ** 50),                             # the object: a payload of PiBs
])
def test_a_single_object_claiming_huge_dimensions_is_refused(tmp_path, claim):
    src, _ = legacy_source(tmp_path)
    names = objects(src)
    for n in names[1:]:
        os.unlink(obj_path(src, n))

    def change(d):
        d.update(claim)
        if "head_dim" in claim:     # a payload length that matches the claimed layout
            d["store"]["shape"] = [1, 1]
            d.update(kv_heads=4, total_kv_heads=4)

    path = obj_path(src, names[0])
    recraft(path, change)
    if "head_dim" in claim:
        recraft(path, payload_len=4 * 2 * 4 * 2 ** 50 * 4 * 4)
    file_as_its_own(src, path)
    res = convert(src, tmp_path / "dst")
    one_line_error(res, 1, "no convertible objects (1 corrupt")
    assert not (tmp_path / "dst").exists()


def test_a_payload_claim_is_checked_against_the_object_size(tmp_path):
    src, _ = legacy_source(tmp_path)
    victim = objects(src)[0]
    recraft(obj_path(src, victim), payload_len=100 * 10 ** 9)   # 100 GB claimed
    res = convert(src, tmp_path / "dst", "--dry-run", "--format", "json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["corrupt"] == 1 and s["objects_in"] == 11
    assert s["bytes_in"] < 10 ** 6


def test_links_out_of_the_store_are_not_followed(tmp_path):
    src, _ = legacy_source(tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(src, outside)                     # sound objects, but not the store's
    fans = sorted(os.listdir(os.path.join(src, "objects")))
    moved = fans[0]
    n_moved = len(os.listdir(os.path.join(src, "objects", moved)))
    shutil.rmtree(os.path.join(src, "objects", moved))
    os.symlink(os.path.join(outside, "objects", moved), os.path.join(src, "objects", moved))
    # and one object file linked to a file outside
    other = next(n for n in objects(outside) if n[:2] != moved)
    os.unlink(obj_path(src, other))
    os.symlink(obj_path(outside, other), obj_path(src, other))
    s = json.loads(convert(src, tmp_path / "dst", "--dry-run", "--format", "json").stdout)
    assert s["objects_in"] == 12 - n_moved - 1
    # objects/ itself a link
    shutil.rmtree(os.path.join(src, "objects"))
    os.symlink(os.path.join(outside, "objects"), os.path.join(src, "objects"))
    one_line_error(convert(src, tmp_path / "dst2"), 1, "symbolic link")


@pytest.mark.parametrize("inside", ["sub", "objects/zz", "tmp", "objects"])
def test_a_destination_inside_the_source_is_refused(tmp_path, inside):
    src, _ = legacy_source(tmp_path)
    before = files(src)
    one_line_error(convert(src, src / inside), 1, "inside the source store")
    os.symlink(src / "objects", tmp_path / "alias")            # through a link
    one_line_error(convert(src, tmp_path / "alias" / "x"), 1, "inside the source store")
    assert files(src) == before


def test_a_source_inside_the_destination_is_refused(tmp_path):
    src, _ = legacy_source(tmp_path)
    one_line_error(convert(src, tmp_path), 1, "is inside the destination")


@pytest.mark.parametrize("to,text", [
    ("legacy:tp=3", "cannot be split over tp=3"),
    ("legacy:tp=2,pp=5", "more pipeline stages than the model's 4 layers"),
    ("unified:layers=1,tp=2", "not both"),
    ("unified:heads=2,pp=2+page_first", "not both"),
])
def test_shapes_the_model_cannot_take_are_usage_errors(tmp_path, to, text):
    src, _ = legacy_source(tmp_path)
    one_line_error(convert(src, tmp_path / "dst", "--to", to), 2, text)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("to", ["legacy:tp=4,pp=100000000", "legacy:tp=100000,pp=100000",
                                "legacy:tp=" + "9" * 40, "legacy:tp=4096,pp=1",
                                "legacy:tp=1,pp=100000", "unified:tp=100000,pp=100000"])
def test_absurd_shapes_are_refused(tmp_path, to):
    """In a process of its own: before the fix these never answered (a test that hangs
    fails at the timeout instead)."""
    src, _ = legacy_source(tmp_path)
    r = subprocess.run([sys.executable, "-m", "hicache_cli.app", "convert-layout", str(src),
                        str(tmp_path / "dst"), "--to", to, "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    if to.startswith("unified"):             # a grid finer than the model: its cells
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- Mooncake endpoints ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from tests.mooncake_master import MooncakeMaster

    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def fleet(master):
    from engine.storage.backends.mooncake import MooncakeBackend

    b = MooncakeBackend(master.config())       # a serving client holds the memory
    yield b
    b.close()


def mc_url(master, host="127.0.0.1", **kw) -> str:
    q = dict(metadata=f"http://127.0.0.1:{master.http_port}/metadata",
             admin=master.metrics_port, **kw)
    return f"mooncake://{host}:{master.rpc_port}?" + "&".join(f"{k}={v}" for k, v in q.items())


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a process of its own (native log lines reach its real stderr; a hang
    fails at ``timeout``)."""
    return subprocess.run([sys.executable, "-m", "hicache_cli.app", "convert-layout",
                           *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


def listed(master) -> list[str]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/get_all_keys") as r:
        return r.read().decode().split()


def test_one_master_named_two_ways_is_the_same_store(tmp_path, master, fleet):
    src, _ = legacy_source(tmp_path)
    assert convert(src, mc_url(master), "--format", "json").exit_code == 0
    before = listed(master)
    for a, b in (("127.0.0.1", "localhost"), ("localhost", "127.0.0.1"),
                 ("127.0.0.1", "0.0.0.0")):
        res = convert(mc_url(master, a), mc_url(master, b), "--to", "unified:layers=1,heads=1")
        one_line_error(res, 1, "same store")
    assert listed(master) == before                 # nothing written into the source


def test_a_successful_run_keeps_native_logs_off_stderr(tmp_path, master, fleet):
    src, _ = legacy_source(tmp_path)
    res = cli(src, mc_url(master), "--to", "unified:layers=4,heads=4", "--verify")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    res = cli(src, mc_url(master), "--to", "unified:layers=4,heads=4", "--verbose")
    assert res.returncode == 0 and len(res.stderr.splitlines()) > 3   # the client's own lines


def test_a_file_metadata_url_is_refused_up_front(tmp_path, master):
    src, _ = legacy_source(tmp_path)
    res = cli(src, mc_url(master).replace(f"http://127.0.0.1:{master.http_port}/metadata",
                                          "file:///tmp/metadata"))
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "http://" in res.stderr


class _Silent:
    """A TCP server that accepts and then never answers; ``dribble``: answers an HTTP request
    with a long body one byte a second."""

    def __init__(self, dribble: bool = False):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        self.dribble, self.stop = dribble, threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.dribble:
                threading.Thread(target=self._drip, args=(c,), daemon=True).start()

    def _drip(self, c) -> None:
        try:
            c.recv(65536)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n")
            while not self.stop.wait(0.5):
                c.sendall(b"k")
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("which", ["master", "metadata", "admin", "dribbling admin"])
def test_silent_servers_time_out_with_one_line(tmp_path, master, fleet, which):
    src, _ = legacy_source(tmp_path)
    silent = _Silent(dribble=which == "dribbling admin")
    try:
        url = mc_url(master, timeout=2)
        if which == "master":
            url = url.replace(f":{master.rpc_port}?", f":{silent.port}?")
        elif which == "metadata":
            url = url.replace(f"127.0.0.1:{master.http_port}", f"127.0.0.1:{silent.port}")
        else:
            url = url.replace(f"admin={master.metrics_port}", f"admin={silent.port}")
        res = cli(url, tmp_path / "dst", timeout=60)
    finally:
        silent.close()
    assert res.returncode == 1, res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and ("did not answer within 2 s" in err[0]
                              or "did not arrive within 2 s" in err[0]
                              or "timed out" in err[0]), res.stderr
    assert not (tmp_path / "dst").exists()
