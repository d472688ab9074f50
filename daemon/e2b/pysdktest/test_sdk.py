# kilnd's E2B API through E2B's own Python SDK (e2b 2.34.0, unmodified, in
# the venv make deps makes here with ../shared/fixtures/e2b-python/setup.sh):
# what sdktest/*.test.mjs check through the npm SDK, the control plane and
# envd, with the sync Sandbox and one test of AsyncSandbox. Run by
# TestE2BPythonSDK (the daemon's test double) and TestKVME2B (real
# sandboxes) with only E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set for
# the SDK, whose key check stays on (the keys are e2b_ and hex, made as
# kiln e2b key new makes them), and KILN_E2B_MODE (double or kvm) and
# KILN_E2B_OTHER_KEY (another tenant's key) for the test.
import asyncio
import base64
import hashlib
import http.client
import io
import json
import os
import random
import socket
import time
import urllib.parse
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileType,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
    Volume,
    VolumeException,
)

MODE = os.environ.get("KILN_E2B_MODE", "kvm")
KVM = MODE == "kvm"
DOUBLE = MODE == "double"
OTHER_KEY = os.environ.get("KILN_E2B_OTHER_KEY")
# A key in E2B's format that no tenant has: the SDK sends it, kilnd refuses it.
UNKNOWN_KEY = "e2b_" + "0" * 40


def until(what, seconds, f):
    """Polls f until it returns true, for at most seconds."""
    end = time.monotonic() + seconds
    while True:
        if f():
            return
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {seconds} s")
        time.sleep(0.2)


def list_all(query=None, **opts):
    out = []
    p = Sandbox.list(query=query, **opts)
    while p.has_next:
        out.extend(p.next_items())
    return out


# --- the control plane ---------------------------------------------------


def test_create_list_metadata_get_info_set_timeout_kill_twice():
    tag = f"t{uuid.uuid4().hex[:12]}"
    # A value the SDK escapes (it quotes each key and value, then
    # form-encodes the pairs: one encoding more than the npm SDK).
    odd = "me@kiln.test a&b=c/é%2F+"
    meta = {"suite": "python", "tag": tag, "odd": odd}
    sbx = Sandbox.create("base", metadata=meta, timeout=60)
    try:
        assert sbx.sandbox_id
        listed = list_all(SandboxQuery(metadata={"tag": tag}))
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert listed[0].metadata == meta
        assert listed[0].state == SandboxState.RUNNING
        assert listed[0].template_id == "base"
        listed = list_all(SandboxQuery(metadata={"odd": odd, "tag": tag}))
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert list_all(SandboxQuery(metadata={"odd": odd + "x", "tag": tag})) == []

        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "base"
        assert info.state == SandboxState.RUNNING
        assert info.metadata == meta
        assert info.cpu_count >= 1 and info.memory_mb >= 64
        life = (info.end_at - info.started_at).total_seconds()
        assert 50 < life <= 61, f"lifetime {life} s"

        sbx.set_timeout(600)
        later = sbx.get_info()
        left = later.end_at.timestamp() - time.time()
        assert left > 500, f"end_at {later.end_at} after set_timeout(600)"
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True
    assert sbx.kill() is False
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    assert sbx.is_running() is False
    assert list_all(SandboxQuery(metadata={"tag": tag})) == []


def test_list_pages_connect_keeps_the_longer_timeout_and_with_kills():
    tag = f"p{uuid.uuid4().hex[:12]}"
    sbxs = [Sandbox.create("base", metadata={"tag": tag}, timeout=120) for _ in range(3)]
    try:
        p = Sandbox.list(SandboxQuery(metadata={"tag": tag}), limit=2)
        pages = []
        while p.has_next:
            pages.append([s.sandbox_id for s in p.next_items()])
        assert [len(x) for x in pages] == [2, 1], pages
        assert sorted(sum(pages, [])) == sorted(s.sandbox_id for s in sbxs)

        # connect to a running sandbox extends its timeout, never shortens it.
        s = sbxs[0]
        end = s.get_info().end_at
        Sandbox.connect(s.sandbox_id, timeout=10)
        assert s.get_info().end_at >= end
        Sandbox.connect(s.sandbox_id, timeout=900)
        assert s.get_info().end_at.timestamp() - time.time() > 800
    finally:
        for s in sbxs:
            s.kill()
    with Sandbox.create("base", timeout=60) as s:
        assert s.commands.run("true").exit_code == 0
    assert Sandbox.kill(s.sandbox_id) is False  # __exit__ killed it


def test_a_sandbox_left_alone_past_its_timeout_is_gone():
    sbx = Sandbox.create("base", timeout=2)

    def gone():
        try:
            Sandbox.get_info(sbx.sandbox_id)
            return False
        except SandboxNotFoundException:
            return True

    until("the timed-out sandbox gone", 60, gone)
    assert sbx.kill() is False


def test_pause_then_connect_files_and_in_kvm_a_background_process_survive():
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write("/tmp/kept.txt", "still here")
        bg = None
        if KVM:
            # timeout=0: envd would end it at the default 60 s.
            bg = sbx.commands.run(
                "while :; do date +%s%N >> /tmp/ticks; sleep 0.2; done", background=True, timeout=0
            )
            # Started is not yet ticking (bash -l reads its profile first).
            until("the background process ticking", 30, lambda: sbx.files.exists("/tmp/ticks"))
        assert sbx.pause() is True
        assert Sandbox.pause(sbx.sandbox_id) is False  # already paused
        assert Sandbox.beta_pause(sbx.sandbox_id) is False  # the older name
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        paused = list_all(SandboxQuery(state=[SandboxState.PAUSED]))
        assert any(s.sandbox_id == sbx.sandbox_id for s in paused)
        running = list_all(SandboxQuery(state=[SandboxState.RUNNING]))
        assert not any(s.sandbox_id == sbx.sandbox_id for s in running)

        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert back.sandbox_id == sbx.sandbox_id
        assert back.get_info().state == SandboxState.RUNNING
        assert back.files.read("/tmp/kept.txt") == "still here"
        if KVM:
            procs = back.commands.list()
            assert any(p.pid == bg.pid for p in procs), f"pid {bg.pid} among {procs}"
            n1 = len(back.files.read("/tmp/ticks").strip().split("\n"))
            until(
                "the background process still ticking",
                30,
                lambda: len(back.files.read("/tmp/ticks").strip().split("\n")) > n1,
            )
        # connect to a running sandbox is fine too, and so is the instance's
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.sandbox_id == sbx.sandbox_id
        assert sbx.connect() is sbx
    finally:
        sbx.kill()


def test_pause_without_memory_keeps_files_not_processes():
    # E2B's semantics: the filesystem is kept, the memory (and with it every
    # process) is not; a connect cold-boots the sandbox under the same ID.
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write("/work/kept-without-memory.txt", "on the writable layer")
        sbx.files.write("/tmp/in-tmp.txt", "in /tmp")
        if KVM:  # the double's commands run on the host: never there
            sbx.commands.run("rm /etc/debian_version && mkdir -p /opt/made && echo x > /opt/made/y")
        bg = sbx.commands.run("exec sleep 3600", background=True, timeout=0)
        assert any(p.pid == bg.pid for p in sbx.commands.list())
        assert sbx.pause(keep_memory=False) is True
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert back.sandbox_id == sbx.sandbox_id
        assert back.files.read("/work/kept-without-memory.txt") == "on the writable layer"
        assert back.files.read("/tmp/in-tmp.txt") == "in /tmp"
        if KVM:
            assert back.files.read("/opt/made/y") == "x\n"
            # A deletion from the image is kept too (a whiteout applied).
            assert back.files.exists("/etc/debian_version") is False
        assert not any(p.pid == bg.pid for p in back.commands.list()), "a process outlived a pause without memory"
        assert back.commands.run("echo booted").stdout == "booted\n"
    finally:
        sbx.kill()


def test_fork_4_children_with_the_parents_files_diverging_after():
    parent = Sandbox.create("base", timeout=300, metadata={"role": "parent"})
    kids = []
    try:
        parent.files.write("/tmp/origin.txt", "parent")
        forked = parent.fork(count=4, timeout=120)
        assert len(forked) == 4
        for k in forked:
            assert not isinstance(k, Exception), f"a child failed: {k!r}"
            kids.append(k)
        assert len({k.sandbox_id for k in kids}) == 4
        for i, k in enumerate(kids):
            assert k.sandbox_id != parent.sandbox_id
            assert k.files.read("/tmp/origin.txt") == "parent"
            k.files.write("/tmp/origin.txt", f"child {i}")
        for i, k in enumerate(kids):
            assert k.files.read("/tmp/origin.txt") == f"child {i}"
        assert parent.files.read("/tmp/origin.txt") == "parent"
        for k in kids:
            k.kill()
        kids = []
        # The static form, one child by default.
        one = Sandbox.fork(parent.sandbox_id, timeout=60)
        assert len(one) == 1 and not isinstance(one[0], Exception), repr(one)
        kids.append(one[0])
        assert one[0].files.read("/tmp/origin.txt") == "parent"
    finally:
        for s in [parent, *kids]:
            s.kill()


def api_post(path, body):
    """A control-plane request the SDK has no call for, sent as the SDK
    sends its own (X-API-KEY, JSON), to the same API."""
    u = urllib.parse.urlparse(os.environ["E2B_API_URL"])
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        c.request("POST", path, body=json.dumps(body),
                  headers={"X-API-KEY": os.environ["E2B_API_KEY"], "Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def test_fork_a_paused_sandbox_and_a_snapshot_into_3_each():
    sbx = Sandbox.create("base", timeout=300)
    kids = []
    try:
        sbx.files.write("/tmp/saved.txt", "saved")
        snap = sbx.create_snapshot()
        sbx.files.write("/tmp/saved.txt", "saved, then paused")
        assert sbx.pause() is True
        # The paused sandbox (its memory on disk, no VMM process) forks
        # from its saved state through the SDK's own call, and stays paused.
        forked = Sandbox.fork(sbx.sandbox_id, count=3, timeout=120)
        assert len(forked) == 3 and not any(isinstance(k, Exception) for k in forked), repr(forked)
        kids.extend(forked)
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        # The snapshot forks through POST /snapshots/{id}/fork.
        status, body = api_post(f"/snapshots/{snap.snapshot_id}/fork", {"count": 3, "timeout": 120})
        assert status == 201 and len(body) == 3 and all(c.get("sandbox") for c in body), body
        from_snap = [Sandbox.connect(c["sandbox"]["sandboxID"]) for c in body]
        kids.extend(from_snap)
        assert len({k.sandbox_id for k in kids}) == 6
        for k in forked:
            assert k.files.read("/tmp/saved.txt") == "saved, then paused"
        for k in from_snap:
            assert k.files.read("/tmp/saved.txt") == "saved"
        for i, k in enumerate(kids):
            k.files.write("/tmp/saved.txt", f"child {i}")
        for i, k in enumerate(kids):
            assert k.files.read("/tmp/saved.txt") == f"child {i}"
        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert back.files.read("/tmp/saved.txt") == "saved, then paused"
    finally:
        for k in kids:
            k.kill()
        sbx.kill()


def test_a_wrong_key_another_tenant_an_unknown_template():
    # The SDK itself refuses a key not in E2B's format, before sending it.
    with pytest.raises(AuthenticationException, match="Invalid API key format"):
        Sandbox.create("base", api_key="kiln-wrong-key-0000")
    # One in the format that no tenant has: kilnd's 401.
    with pytest.raises(AuthenticationException, match="401"):
        Sandbox.create("base", api_key=UNKNOWN_KEY)
    with pytest.raises(AuthenticationException, match="401"):
        list_all(api_key=UNKNOWN_KEY)

    sbx = Sandbox.create("base", timeout=60)
    try:
        assert OTHER_KEY, "KILN_E2B_OTHER_KEY"
        o = {"api_key": OTHER_KEY}
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sbx.sandbox_id, **o)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sbx.sandbox_id, **o)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.set_timeout(sbx.sandbox_id, 10, **o)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(sbx.sandbox_id, **o)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.pause(sbx.sandbox_id, **o)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id, **o)
        assert Sandbox.kill(sbx.sandbox_id, **o) is False
        assert not any(s.sandbox_id == sbx.sandbox_id for s in list_all(**o))
        assert sbx.get_info().state == SandboxState.RUNNING  # untouched
        assert sbx.commands.run("echo still mine").stdout == "still mine\n"
    finally:
        sbx.kill()

    with pytest.raises(SandboxException) as ei:
        Sandbox.create("no-such-template")
    assert "no-such-template" in str(ei.value) and "not found" in str(ei.value), str(ei.value)


def test_volumes_written_in_one_sandbox_read_in_the_next_one_writer_at_a_time():
    name = f"py{int(time.time() * 1000)}"
    vol = Volume.create(name)
    try:
        assert vol.name == name
        assert any(v.volume_id == vol.volume_id and v.name == name for v in Volume.list())
        assert Volume.get_info(vol.volume_id).name == name
        with pytest.raises(VolumeException, match="already exists"):
            Volume.create(name)
        with pytest.raises(NotFoundException):
            Volume.get_info(vol.volume_id, api_key=OTHER_KEY)
        assert Volume.destroy(vol.volume_id, api_key=OTHER_KEY) is False

        a = Sandbox.create("base", timeout=300, volume_mounts={"/mnt/data": vol})
        try:
            a.files.write("/mnt/data/hello.txt", "from a\n")
            if KVM:
                r = a.commands.run("echo more >> /mnt/data/hello.txt && sync && stat -f -c %T /mnt/data && stat -c %a /mnt/data")
                assert r.stdout == "ext2/ext3\n1777\n"
            with pytest.raises(SandboxException, match="mounted in sandbox"):
                Sandbox.create("base", volume_mounts={"/data": name})
            with pytest.raises(VolumeException, match="mounted in sandbox"):
                Volume.destroy(vol.volume_id)
        finally:
            a.kill()
        b = Sandbox.create("base", timeout=300, volume_mounts={"/data": name})
        try:
            assert b.files.read("/data/hello.txt") == ("from a\nmore\n" if KVM else "from a\n")
        finally:
            b.kill()
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert not any(v.volume_id == vol.volume_id for v in Volume.list())


def test_snapshots_take_list_create_from_delete():
    sbx = Sandbox.create("base", timeout=300)
    frm = None
    try:
        sbx.files.write("/tmp/snap.txt", "in the snapshot")
        snap = sbx.create_snapshot(name=f"snap-{uuid.uuid4().hex[:8]}")
        assert snap.snapshot_id
        assert len(snap.names) == 1
        listed = []
        p = Sandbox.list_snapshots()
        while p.has_next:
            listed.extend(p.next_items())
        assert any(s.snapshot_id == snap.snapshot_id for s in listed)
        # The sandbox's own, and by name or ID.
        assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [snap.snapshot_id]
        for name in (snap.names[0], snap.snapshot_id):
            got = Sandbox.list_snapshots(name=name).next_items()
            assert [s.snapshot_id for s in got] == [snap.snapshot_id], name
        sbx.files.write("/tmp/snap.txt", "after the snapshot")

        frm = Sandbox.create(snap.snapshot_id, timeout=60)
        assert frm.files.read("/tmp/snap.txt") == "in the snapshot"
        frm.kill()
        frm = None
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        sbx.kill()
        if frm is not None:
            frm.kill()


def test_metrics():
    sbx = Sandbox.create("base", timeout=60)
    try:
        m = sbx.get_metrics()
        assert len(m) >= 1, "at least the sample taken now"
        last = m[-1]
        assert abs(last.timestamp.timestamp() - time.time()) < 60, str(last.timestamp)
        assert last.cpu_count >= 1
        assert 0 <= last.cpu_used_pct <= 100
        # The test double's "guest memory" is its files: an empty one uses none.
        assert last.mem_total > 0 and last.mem_used <= last.mem_total
        if KVM:
            assert last.mem_used > 0, "a real guest uses some memory"
        assert last.disk_total > 0 and last.disk_used <= last.disk_total
        none = sbx.get_metrics(start=datetime.now(timezone.utc) + timedelta(hours=1))
        assert none == []
    finally:
        sbx.kill()


# --- envd: commands and files of one sandbox ------------------------------


@pytest.fixture(scope="module")
def sbx():
    # Without a timeout the SDK asks for 300 s; the module's tests take less.
    s = Sandbox.create(envs={"FROM_CREATE": "sandbox-wide"})
    # Commands of the double run in the sandbox's folder only where a
    # working directory is given: give every one that touches files one.
    try:
        s.files.make_dir("/work")
    except SandboxException:
        pass
    yield s
    s.kill()


def test_commands_run_prints_hello(sbx):
    r = sbx.commands.run("echo hello")
    assert r.exit_code == 0
    assert r.stdout == "hello\n"
    assert r.error is None or r.error == ""
    # As a user by name (the SDK's Basic authorization header).
    r = sbx.commands.run("id -un", user="root")
    # The double's commands run on the host, as the test's user.
    assert DOUBLE or r.stdout == "root\n", r.stdout


def test_a_nonzero_exit_is_a_command_exit_exception_with_its_code_and_stderr(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo oops >&2; exit 3")
    err = ei.value
    assert err.exit_code == 3
    assert err.stdout == "out\n"
    # The double runs bash -l on the host, whose profile may complain.
    assert err.stderr.endswith("oops\n") if DOUBLE else err.stderr == "oops\n", err.stderr


def test_envs_and_cwd_are_honoured(sbx):
    sbx.files.make_dir("/work/cwd")
    r = sbx.commands.run(
        'echo "$GREETING"; echo "$FROM_CREATE"; pwd', envs={"GREETING": "hi there"}, cwd="/work/cwd"
    )
    greeting, from_create, pwd = r.stdout.rstrip("\n").split("\n")
    assert greeting == "hi there"
    assert from_create == "sandbox-wide"
    # The double's commands run on the host, in the sandbox's folder.
    assert pwd.endswith("/work/cwd") if DOUBLE else pwd == "/work/cwd", pwd


def test_on_stdout_streams_before_the_command_ends(sbx):
    # The sync SDK calls on_stdout as the output comes: the first line
    # comes 2 s before the command ends.
    seen = []
    errs = []
    r = sbx.commands.run(
        "echo first; sleep 2; echo second; echo err >&2",
        on_stdout=lambda d: seen.append((d, time.monotonic())),
        on_stderr=lambda d: errs.append(d),
    )
    ended = time.monotonic()
    assert r.stdout == "first\nsecond\n"
    # The double runs bash -l on the host, whose profile may complain.
    assert r.stderr.endswith("err\n") if DOUBLE else r.stderr == "err\n", r.stderr
    assert "".join(errs) == r.stderr
    assert seen and seen[0][0].startswith("first"), seen
    assert ended - seen[0][1] > 1.5, f"first seen {ended - seen[0][1]:.2f} s before the end"


def test_a_command_past_its_timeout_is_killed(sbx):
    # envd ends a command at its timeout (60 s unless given), not only the
    # stream that follows it: background ones too.
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo late", timeout=2)
    assert time.monotonic() - start < 20, "the call was not cut at its timeout"
    until("the timed-out command gone", 10, lambda: not any("sleep 30" in " ".join(p.args) for p in sbx.commands.list()))
    h = sbx.commands.run("sleep 30", background=True, timeout=2)
    with pytest.raises((TimeoutException, CommandExitException)):
        h.wait()
    until("the timed-out background command gone", 10, lambda: not any(p.pid == h.pid for p in sbx.commands.list()))
    # timeout=0: no limit.
    h = sbx.commands.run("sleep 3; echo done", background=True, timeout=0)
    assert h.wait().stdout == "done\n"


def test_a_background_command_runs_on_until_kill(sbx):
    h = sbx.commands.run("echo started; sleep 600", background=True)
    assert h.pid > 0
    listed = sbx.commands.list()
    assert any(p.pid == h.pid for p in listed), listed
    mine = next(p for p in listed if p.pid == h.pid)
    assert "sleep 600" in " ".join([mine.cmd, *mine.args])
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(h.pid) is False
    assert not any(p.pid == h.pid for p in sbx.commands.list())


def test_commands_connect_reattaches_to_a_background_command(sbx):
    h = sbx.commands.run("sleep 1; echo later", background=True)
    again = sbx.commands.connect(h.pid)
    r = again.wait()
    assert r.exit_code == 0
    assert r.stdout.endswith("later\n"), r.stdout


def test_stdin_reaches_a_command(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "typed\n")
    h.send_stdin(b"bytes too\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "typed\nbytes too\n"


def test_a_pty_is_created_typed_into_resized_and_killed(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    out = bytearray()

    # The sync handle yields the pty's output as it iterates; read it until
    # the expected text shows.
    it = iter(h)

    def wait_for(s):
        end = time.monotonic() + 20
        while s.encode() not in out:
            if time.monotonic() > end:
                pytest.fail(f"no {s!r} in {bytes(out)!r}")
            _, _, pty = next(it)
            if pty is not None:
                out.extend(pty)

    sbx.pty.send_stdin(h.pid, b"stty size\n")
    wait_for("24 80")
    sbx.pty.resize(h.pid, PtySize(rows=43, cols=132))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    wait_for("43 132")
    assert sbx.pty.kill(h.pid) is True
    for _ in it:  # to the end event
        pass
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1  # killed by a signal


def test_files_write_and_read_round_trip_text_and_5_mib_of_binary(sbx):
    info = sbx.files.write("/work/a.txt", "some text\n")
    assert info.path == "/work/a.txt" and info.name == "a.txt"
    assert sbx.files.read("/work/a.txt") == "some text\n"
    assert sbx.files.read("/work/a.txt", format="bytes") == bytearray(b"some text\n")
    big = os.urandom(5 << 20)
    sbx.files.write("/work/big.bin", big)
    got = sbx.files.read("/work/big.bin", format="bytes")
    assert len(got) == len(big)
    assert bytes(got) == big, "the bytes read differ from those written"
    streamed = b"".join(sbx.files.read("/work/big.bin", format="stream"))
    assert streamed == big
    # Every byte value, including invalid UTF-8, through a file-like object.
    every = bytes(range(256)) * 4
    sbx.files.write("/work/every.bin", io.BytesIO(every))
    assert bytes(sbx.files.read("/work/every.bin", format="bytes")) == every
    # gzip-compressed on the wire (octet-stream, Content-Encoding: gzip).
    sbx.files.write("/work/gz.bin", big[:100000], gzip=True)
    assert bytes(sbx.files.read("/work/gz.bin", format="bytes")) == big[:100000]
    # An empty file.
    sbx.files.write("/work/empty", "")
    assert sbx.files.read("/work/empty") == ""
    # Several files in one request.
    infos = sbx.files.write_files(
        [{"path": "/work/m/one.txt", "data": "1"}, {"path": "/work/m/two.bin", "data": b"\x00\x02"}]
    )
    assert sorted(i.path for i in infos) == ["/work/m/one.txt", "/work/m/two.bin"]
    assert sbx.files.read("/work/m/one.txt") == "1"
    assert bytes(sbx.files.read("/work/m/two.bin", format="bytes")) == b"\x00\x02"
    with pytest.raises(NotFoundException):
        sbx.files.read("/work/no-such-file")


def test_list_exists_get_info_make_dir_remove_and_rename(sbx):
    assert sbx.files.make_dir("/work/fs/sub") is True
    assert sbx.files.make_dir("/work/fs/sub") is False
    sbx.files.write("/work/fs/f.txt", "xyz")
    entries = sbx.files.list("/work/fs")
    names = sorted(f"{e.name}:{e.type.value}" for e in entries)
    assert names == ["f.txt:file", "sub:dir"]
    f = next(e for e in entries if e.name == "f.txt")
    assert f.type == FileType.FILE and f.size == 3 and f.path == "/work/fs/f.txt"
    deep = sorted(e.path for e in sbx.files.list("/work/fs", depth=2))
    assert deep == ["/work/fs/f.txt", "/work/fs/sub"]
    st = sbx.files.get_info("/work/fs/sub")
    assert st.type == FileType.DIR and st.name == "sub"
    assert sbx.files.exists("/work/fs/f.txt") is True
    assert sbx.files.exists("/work/fs/nope") is False
    moved = sbx.files.rename("/work/fs/f.txt", "/work/fs/g.txt")
    assert moved.path == "/work/fs/g.txt"
    assert sbx.files.exists("/work/fs/f.txt") is False
    assert sbx.files.read("/work/fs/g.txt") == "xyz"
    sbx.files.remove("/work/fs")
    assert sbx.files.exists("/work/fs") is False


def test_watch_dir_reports_a_file_a_command_creates(sbx):
    # The sync SDK polls a watcher (CreateWatcher, GetWatcherEvents,
    # RemoveWatcher), unlike the npm SDK's stream.
    sbx.files.make_dir("/work/watched")
    w = sbx.files.watch_dir("/work/watched")
    try:
        sbx.commands.run("echo x > made.txt", cwd="/work/watched")
        events = []

        def seen():
            events.extend(w.get_new_events())
            return any(e.name.endswith("made.txt") for e in events)

        until(f"an event of made.txt (got {events})", 20, seen)
        kinds = {e.type for e in events if e.name.endswith("made.txt")}
        assert kinds & {FilesystemEventType.CREATE, FilesystemEventType.WRITE}, events
    finally:
        w.stop()
    with pytest.raises(SandboxException):
        w.get_new_events()

    # Recursive: the events of a subfolder, named from the watched one.
    sbx.files.make_dir("/work/watched/sub")
    w = sbx.files.watch_dir("/work/watched", recursive=True)
    try:
        sbx.commands.run("echo x > sub/deep.txt; rm sub/deep.txt", cwd="/work/watched")
        events = []

        def removed():
            events.extend(w.get_new_events())
            return any(e.name == "sub/deep.txt" and e.type == FilesystemEventType.REMOVE for e in events)

        until(f"the removal of sub/deep.txt (got {events})", 20, removed)
    finally:
        w.stop()


def test_async_sandbox_runs_a_command_streams_a_watch_and_kills():
    # AsyncSandbox is what most agent frameworks call; its watch_dir is the
    # WatchDir stream the npm SDK uses.
    async def main():
        s = await AsyncSandbox.create("base", timeout=120)
        try:
            r = await s.commands.run("echo async")
            assert r.stdout == "async\n"
            await s.files.make_dir("/work/aw")
            got = asyncio.Event()
            events = []

            def on_event(ev):
                events.append(ev)
                if ev.name.endswith("made.txt"):
                    got.set()

            w = await s.files.watch_dir("/work/aw", on_event)
            try:
                await s.commands.run("echo x > made.txt", cwd="/work/aw")
                await asyncio.wait_for(got.wait(), 20)
            finally:
                await w.stop()
            await s.files.write("/work/aw/b.bin", b"\x00\xffasync")
            assert bytes(await s.files.read("/work/aw/b.bin", format="bytes")) == b"\x00\xffasync"
            listed = []
            p = AsyncSandbox.list(SandboxQuery(metadata={}))
            while p.has_next:
                listed.extend(await p.next_items())
            assert any(x.sandbox_id == s.sandbox_id for x in listed)
        finally:
            assert await s.kill() is True
        assert await AsyncSandbox.kill(s.sandbox_id) is False

    asyncio.run(main())


# --- a sandbox's ports -----------------------------------------------------

# A WebSocket echo server, for the guest: Python's standard library only.
WS_ECHO = r'''
import base64, hashlib, socket, struct, sys
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
while True:
    c, _ = s.accept()
    f = c.makefile("rb")
    key = ""
    while True:
        line = f.readline().decode()
        if line in ("\r\n", ""):
            break
        k, _, v = line.partition(":")
        if k.strip().lower() == "sec-websocket-key":
            key = v.strip()
    acc = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
               "Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n" % acc).encode())
    while True:
        h = f.read(2)
        if len(h) < 2:
            break
        op, n = h[0] & 0x0F, h[1] & 0x7F
        if n == 126:
            n = struct.unpack(">H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            break
        if n < 126:
            hdr = bytes([0x80 | op, n])
        else:
            hdr = bytes([0x80 | op]) + struct.pack(">BH", 126, n)
        c.sendall(hdr + data)
    c.close()
'''


def api_addr():
    u = urllib.parse.urlparse(os.environ["E2B_API_URL"])
    return u.hostname, u.port


def port_get(host, path="/", token=None):
    """GETs path through kilnd's E2B listener with the Host header
    getHost gave, as a client resolving that name to it would."""
    c = http.client.HTTPConnection(*api_addr(), timeout=60)
    try:
        h = {"Host": host}
        if token:
            h["E2b-Traffic-Access-Token"] = token
        c.request("GET", path, headers=h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def ws_echo(host, token, text):
    """Opens a WebSocket through the listener, sends one text frame and
    returns the frame that comes back."""
    key = base64.b64encode(os.urandom(16)).decode()
    s = socket.create_connection(api_addr(), timeout=60)
    try:
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   f"Sec-WebSocket-Version: 13\r\nE2b-Traffic-Access-Token: {token}\r\n\r\n").encode())
        f = s.makefile("rb")
        status = f.readline().decode()
        assert status.startswith("HTTP/1.1 101"), status
        accept = ""
        while True:
            line = f.readline().decode()
            if line == "\r\n":
                break
            k, _, v = line.partition(":")
            if k.lower() == "sec-websocket-accept":
                accept = v.strip()
        want = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        assert accept == want
        data = text.encode()
        mask = os.urandom(4)
        s.sendall(bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
        h = f.read(2)
        assert h[0] == 0x81, h
        return f.read(h[1] & 0x7F).decode()
    finally:
        s.close()


def test_get_host_reaches_servers_in_the_sandbox_behind_its_traffic_token():
    # The double's sandboxes are the host: its ports are the host's.
    web, ws = (random.randint(20000, 59999), random.randint(20000, 59999)) if DOUBLE else (8000, 8765)
    sbx = Sandbox.create("base", timeout=300, network={"allow_public_traffic": False})
    other = Sandbox.create("base", timeout=300, network={"allow_public_traffic": False})
    try:
        assert sbx.traffic_access_token and other.traffic_access_token
        assert sbx.traffic_access_token != other.traffic_access_token
        sbx.files.make_dir("/work/www")
        sbx.files.write("/work/www/hello.txt", "hello from the sandbox\n")
        sbx.files.write("/work/ws_echo.py", WS_ECHO)
        # Servers on the guest's loopback only: the path in is not its network.
        sbx.commands.run(f"exec python3 -m http.server {web} --bind 127.0.0.1", background=True, cwd="/work/www")
        sbx.commands.run(f"exec python3 ws_echo.py {ws}", background=True, cwd="/work")
        host = sbx.get_host(web)
        assert host.startswith(f"{web}-{sbx.sandbox_id}.")
        until("the web server", 120, lambda: port_get(host, "/hello.txt", sbx.traffic_access_token)[0] == 200)
        assert port_get(host, "/hello.txt", sbx.traffic_access_token) == (200, b"hello from the sandbox\n")
        # Private: no token, or another sandbox's, is 401.
        assert port_get(host, "/hello.txt")[0] == 401
        assert port_get(host, "/hello.txt", other.traffic_access_token)[0] == 401
        # This sandbox's token opens no port of another sandbox; the other's
        # own token reaches it, where nothing listens on that port: 502 (the
        # double's sandboxes share the host's ports).
        assert port_get(other.get_host(web), "/hello.txt", sbx.traffic_access_token)[0] == 401
        if KVM:
            assert port_get(other.get_host(web), "/hello.txt", other.traffic_access_token)[0] == 502
        def echoes():
            try:
                return ws_echo(sbx.get_host(ws), sbx.traffic_access_token, "echo through kiln") == "echo through kiln"
            except (AssertionError, OSError):
                return False  # not listening yet: a 502

        until("the WebSocket echo", 120, echoes)
        # A fork's child runs the parent's servers from the same memory: its
        # ports are its own, behind its own token.
        kids = sbx.fork(count=1, timeout=120)
        assert len(kids) == 1 and not isinstance(kids[0], Exception), repr(kids)
        child = kids[0]
        try:
            assert child.traffic_access_token not in (None, sbx.traffic_access_token)
            until("the child's web server", 120,
                  lambda: port_get(child.get_host(web), "/hello.txt", child.traffic_access_token)[0] == 200)
            assert port_get(child.get_host(web), "/hello.txt", child.traffic_access_token) == (200, b"hello from the sandbox\n")
            assert port_get(child.get_host(web), "/hello.txt", sbx.traffic_access_token)[0] == 401
        finally:
            child.kill()
    finally:
        sbx.kill()
        other.kill()
