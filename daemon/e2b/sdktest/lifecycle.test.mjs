// The control plane through the unmodified E2B SDK: create, list,
// getInfo, setTimeout, kill, timeouts, pause and connect, fork, auth and
// tenants, templates, snapshots, metrics. Run by TestE2BSDK (the
// daemon's test double) and TestKVME2B (real sandboxes) with only
// E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set for the SDK, and
// KILN_E2B_MODE (double or kvm) and KILN_E2B_OTHER_KEY (another tenant's
// key) for the test.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, AuthenticationError, SandboxNotFoundError, SandboxError, Volume, VolumeError, VolumeNotFoundError } from 'e2b'

const kvm = process.env.KILN_E2B_MODE === 'kvm'
const otherKey = process.env.KILN_E2B_OTHER_KEY
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

// until polls f until it returns true, for at most ms.
async function until(what, ms, f) {
  const end = Date.now() + ms
  for (;;) {
    if (await f()) return
    if (Date.now() > end) assert.fail(`${what}: not within ${ms} ms`)
    await sleep(200)
  }
}

async function listAll(opts) {
  const out = []
  const p = Sandbox.list(opts)
  while (p.hasNext) out.push(...(await p.nextItems()))
  return out
}

test('create, list with metadata, getInfo, setTimeout, kill twice', async () => {
  const tag = `t${Date.now()}`
  const sbx = await Sandbox.create('base', { metadata: { suite: 'lifecycle', tag }, timeoutMs: 60_000 })
  try {
    assert.ok(sbx.sandboxId)
    const listed = await listAll({ query: { metadata: { tag } } })
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
    assert.equal(listed[0].metadata.tag, tag)
    assert.equal(listed[0].state, 'running')
    assert.equal(listed[0].templateId, 'base')

    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.equal(info.state, 'running')
    assert.deepEqual(info.metadata, { suite: 'lifecycle', tag })
    assert.ok(info.cpuCount >= 1 && info.memoryMB >= 64)
    const life = info.endAt - info.startedAt
    assert.ok(life > 50_000 && life <= 61_000, `lifetime ${life} ms`)

    await sbx.setTimeout(600_000)
    const later = await sbx.getInfo()
    assert.ok(later.endAt - Date.now() > 500_000, `endAt ${later.endAt.toISOString()} after setTimeout(10 min)`)
  } finally {
    assert.equal(await sbx.kill(), true)
  }
  assert.equal(await sbx.kill(), false)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
  const after = await listAll({ query: { metadata: { tag } } })
  assert.equal(after.length, 0)
})

test('a sandbox left alone past its timeout is gone', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 2_000 })
  await until('the timed-out sandbox gone', 60_000, async () => {
    try {
      await Sandbox.getInfo(sbx.sandboxId)
      return false
    } catch (e) {
      if (e instanceof SandboxNotFoundError) return true
      throw e
    }
  })
  assert.equal(await sbx.kill(), false)
})

test('pause then connect: files (and in kvm a background process) survive', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000 })
  try {
    await sbx.files.write('/tmp/kept.txt', 'still here')
    let bg
    if (kvm) {
      // timeoutMs 0: envd ends a command at its timeout (60 s unless given), background ones too.
      bg = await sbx.commands.run('while :; do date +%s%N >> /tmp/ticks; sleep 0.2; done', { background: true, timeoutMs: 0 })
      // Started is not yet ticking (bash -l reads its profile first).
      await until('the background process ticking', 30_000, () => sbx.files.exists('/tmp/ticks'))
    }
    assert.equal(await sbx.pause(), true)
    assert.equal(await Sandbox.pause(sbx.sandboxId), false) // already paused
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const paused = await listAll({ query: { state: ['paused'] } })
    assert.ok(paused.some((s) => s.sandboxId === sbx.sandboxId))

    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
    assert.equal(back.sandboxId, sbx.sandboxId)
    assert.equal((await back.getInfo()).state, 'running')
    assert.equal(await back.files.read('/tmp/kept.txt'), 'still here')
    if (kvm) {
      const procs = await back.commands.list()
      assert.ok(procs.some((p) => p.pid === bg.pid), `pid ${bg.pid} among ${JSON.stringify(procs)}`)
      const n1 = (await back.files.read('/tmp/ticks')).trim().split('\n').length
      await until('the background process still ticking', 30_000, async () =>
        (await back.files.read('/tmp/ticks')).trim().split('\n').length > n1)
    }
    // connect to a running sandbox is fine too
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
  } finally {
    await sbx.kill()
  }
})

test('fork: 4 children with the parent\'s files, diverging after', async () => {
  const parent = await Sandbox.create('base', { timeoutMs: 300_000, metadata: { role: 'parent' } })
  const kids = []
  try {
    await parent.files.write('/tmp/origin.txt', 'parent')
    const forked = await parent.fork({ count: 4, timeoutMs: 120_000 })
    assert.equal(forked.length, 4)
    for (const k of forked) {
      assert.ok(!(k instanceof Error), `a child failed: ${k}`)
      kids.push(k)
    }
    assert.equal(new Set(kids.map((k) => k.sandboxId)).size, 4)
    for (const [i, k] of kids.entries()) {
      assert.notEqual(k.sandboxId, parent.sandboxId)
      assert.equal(await k.files.read('/tmp/origin.txt'), 'parent')
      await k.files.write('/tmp/origin.txt', `child ${i}`)
    }
    for (const [i, k] of kids.entries()) {
      assert.equal(await k.files.read('/tmp/origin.txt'), `child ${i}`)
    }
    assert.equal(await parent.files.read('/tmp/origin.txt'), 'parent')
  } finally {
    await Promise.all([parent, ...kids].map((s) => s.kill()))
  }
})

test('a wrong key, another tenant, an unknown template', async () => {
  await assert.rejects(Sandbox.create('base', { apiKey: 'kiln-wrong-key-0000' }), AuthenticationError)
  await assert.rejects(listAll({ apiKey: 'kiln-wrong-key-0000' }), AuthenticationError)

  const sbx = await Sandbox.create('base', { timeoutMs: 60_000 })
  try {
    assert.ok(otherKey, 'KILN_E2B_OTHER_KEY')
    const o = { apiKey: otherKey }
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId, o), SandboxNotFoundError)
    await assert.rejects(Sandbox.connect(sbx.sandboxId, o), SandboxNotFoundError)
    await assert.rejects(Sandbox.setTimeout(sbx.sandboxId, 10_000, o), SandboxNotFoundError)
    await assert.rejects(Sandbox.fork(sbx.sandboxId, o), SandboxNotFoundError)
    assert.equal(await Sandbox.kill(sbx.sandboxId, o), false)
    assert.ok(!(await listAll(o)).some((s) => s.sandboxId === sbx.sandboxId))
    assert.equal((await sbx.getInfo()).state, 'running') // untouched
  } finally {
    await sbx.kill()
  }

  await assert.rejects(Sandbox.create('no-such-template'), (e) => {
    assert.ok(e instanceof SandboxError, String(e))
    assert.match(e.message, /no-such-template/)
    assert.match(e.message, /not found/)
    return true
  })
})

test('volumes: written in one sandbox, read in the next; read-write in one at a time', async () => {
  const name = `v${Date.now()}`
  const vol = await Volume.create(name)
  try {
    assert.equal(vol.name, name)
    assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId && v.name === name))
    assert.equal((await Volume.getInfo(vol.volumeId)).name, name)
    await assert.rejects(Volume.create(name), VolumeError) // names are unique
    await assert.rejects(Volume.getInfo(vol.volumeId, { apiKey: otherKey }), VolumeNotFoundError)
    assert.equal(await Volume.destroy(vol.volumeId, { apiKey: otherKey }), false)

    const a = await Sandbox.create('base', { timeoutMs: 300_000, volumeMounts: { '/mnt/data': vol } })
    try {
      assert.deepEqual((await a.getInfo()).volumeMounts, [{ name, path: '/mnt/data' }])
      await a.files.write('/mnt/data/hello.txt', 'from a\n')
      if (kvm) {
        // An ext4 file system of its own, whose root any guest user writes.
        const r = await a.commands.run('echo more >> /mnt/data/hello.txt && sync && stat -f -c %T /mnt/data && stat -c %a /mnt/data')
        assert.equal(r.stdout, 'ext2/ext3\n1777\n')
      }
      // Read-write in one sandbox at a time: a second is refused while a
      // has it, and so is its deletion.
      await assert.rejects(Sandbox.create('base', { volumeMounts: { '/data': name } }), (e) => {
        assert.match(e.message, /mounted in sandbox/)
        return true
      })
      await assert.rejects(Volume.destroy(vol.volumeId), (e) => {
        assert.ok(e instanceof VolumeError, String(e))
        assert.match(e.message, /mounted in sandbox/)
        return true
      })
    } finally {
      await a.kill()
    }
    const b = await Sandbox.create('base', { timeoutMs: 300_000, volumeMounts: { '/data': name } })
    try {
      assert.equal(await b.files.read('/data/hello.txt'), kvm ? 'from a\nmore\n' : 'from a\n')
    } finally {
      await b.kill()
    }
    await assert.rejects(Sandbox.create('base', { volumeMounts: { '/data': 'no-such-volume' } }), /no-such-volume/)
  } finally {
    assert.equal(await Volume.destroy(vol.volumeId), true)
  }
  assert.ok(!(await Volume.list()).some((v) => v.volumeId === vol.volumeId))
})

test('snapshots: take, list, create from, delete', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000 })
  let from
  try {
    await sbx.files.write('/tmp/snap.txt', 'in the snapshot')
    const snap = await sbx.createSnapshot({ name: `snap-${Date.now()}` })
    assert.ok(snap.snapshotId)
    assert.equal(snap.names.length, 1)
    const listed = []
    const p = Sandbox.listSnapshots()
    while (p.hasNext) listed.push(...(await p.nextItems()))
    assert.ok(listed.some((s) => s.snapshotId === snap.snapshotId))
    await sbx.files.write('/tmp/snap.txt', 'after the snapshot')

    from = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
    assert.equal(await from.files.read('/tmp/snap.txt'), 'in the snapshot')
    await from.kill()
    from = undefined
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  } finally {
    await sbx.kill()
    if (from) await from.kill()
  }
})

test('metrics', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 60_000 })
  try {
    const m = await sbx.getMetrics()
    assert.ok(m.length >= 1, 'at least the sample taken now')
    const last = m[m.length - 1]
    assert.ok(last.timestamp instanceof Date && Math.abs(last.timestamp - Date.now()) < 60_000, String(last.timestamp))
    assert.ok(last.cpuCount >= 1)
    assert.ok(last.cpuUsedPct >= 0 && last.cpuUsedPct <= 100)
    // The test double's "guest memory" is its files: an empty one uses none.
    assert.ok(last.memTotal > 0 && last.memUsed <= last.memTotal, `memUsed ${last.memUsed} of ${last.memTotal}`)
    if (kvm) assert.ok(last.memUsed > 0, 'a real guest uses some memory')
    assert.ok(last.diskTotal > 0 && last.diskUsed <= last.diskTotal)
    const none = await sbx.getMetrics({ start: new Date(Date.now() + 3_600_000) })
    assert.equal(none.length, 0)
  } finally {
    await sbx.kill()
  }
})
