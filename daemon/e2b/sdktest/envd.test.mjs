// envd through the unmodified e2b SDK: commands, ptys and files of a
// sandbox kilnd serves. Self-contained: it reads only E2B_API_KEY,
// E2B_API_URL, E2B_SANDBOX_URL and KILN_E2B_MODE (double: kilnd over its
// test double, where commands run on the host in the sandbox's folder;
// kvm: real sandboxes), and creates its own sandboxes.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import http from 'node:http'
import { Sandbox, CommandExitError } from 'e2b'

const mode = process.env.KILN_E2B_MODE ?? 'kvm'
const double = mode === 'double'

let sbx

before(async () => {
  // Without a timeout the API gives 15 s, as E2B's does: the file's tests take longer.
  sbx = await Sandbox.create({ timeoutMs: 600_000 })
  // Commands of the double run in the sandbox's folder only where a
  // working directory is given: give every one that touches files one.
  await sbx.files.makeDir('/work').catch(() => {})
})

after(async () => {
  await sbx?.kill()
})

test('commands.run prints hello', async () => {
  const r = await sbx.commands.run('echo hello')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n')
})

test('a non-zero exit is a CommandExitError with its code and stderr', async () => {
  await assert.rejects(sbx.commands.run('echo oops >&2; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError, `got ${err}`)
    assert.equal(err.exitCode, 3)
    // The double runs bash -l on the host, whose profile may complain.
    assert.ok(double ? err.stderr.endsWith('oops\n') : err.stderr === 'oops\n', err.stderr)
    return true
  })
})

test('envs and cwd are honoured', async () => {
  await sbx.files.makeDir('/work/cwd')
  const r = await sbx.commands.run('echo "$GREETING"; pwd', { envs: { GREETING: 'hi there' }, cwd: '/work/cwd' })
  const [greeting, pwd] = r.stdout.trimEnd().split('\n')
  assert.equal(greeting, 'hi there')
  // The double's commands run on the host, in the sandbox's folder.
  assert.ok(double ? pwd.endsWith('/work/cwd') : pwd === '/work/cwd', pwd)
})

test('onStdout streams before the command ends', async () => {
  const seen = []
  let ended = false
  const run = sbx.commands.run('echo first; sleep 2; echo second', {
    onStdout: (d) => seen.push({ d, ended }),
  }).then((r) => {
    ended = true
    return r
  })
  const r = await run
  assert.equal(r.stdout, 'first\nsecond\n')
  assert.ok(seen.length >= 1 && seen[0].d.startsWith('first') && !seen[0].ended, JSON.stringify(seen))
})

test('a background command runs on until kill()', async () => {
  const h = await sbx.commands.run('echo started; sleep 600', { background: true })
  const listed = await sbx.commands.list()
  assert.ok(listed.some((p) => p.pid === h.pid), JSON.stringify(listed))
  assert.equal(await h.kill(), true)
  await assert.rejects(h.wait(), CommandExitError)
  assert.equal(await sbx.commands.kill(h.pid), false)
})

test('stdin reaches a command', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'typed\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'typed\n')
})

test('a pty is created, typed into, resized and killed', async () => {
  let out = ''
  const dec = new TextDecoder()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d) } })
  const waitFor = async (s) => {
    for (let i = 0; i < 200 && !out.includes(s); i++) await new Promise((r) => setTimeout(r, 50))
    assert.ok(out.includes(s), `no ${JSON.stringify(s)} in ${JSON.stringify(out)}`)
  }
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('stty size\n'))
  await waitFor('24 80')
  await sbx.pty.resize(h.pid, { cols: 132, rows: 43 })
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('stty size\n'))
  await waitFor('43 132')
  assert.equal(await sbx.pty.kill(h.pid), true)
  await assert.rejects(h.wait())
})

test('files.write and read round-trip text and 5 MiB of binary', async () => {
  await sbx.files.write('/work/a.txt', 'some text\n')
  assert.equal(await sbx.files.read('/work/a.txt'), 'some text\n')
  const big = new Uint8Array(randomBytes(5 << 20))
  await sbx.files.write('/work/big.bin', big)
  const got = await sbx.files.read('/work/big.bin', { format: 'bytes' })
  assert.equal(got.length, big.length)
  assert.ok(Buffer.from(got).equals(Buffer.from(big)), 'the bytes read differ from those written')
})

test('list, exists, makeDir, remove and rename', async () => {
  assert.equal(await sbx.files.makeDir('/work/fs/sub'), true)
  assert.equal(await sbx.files.makeDir('/work/fs/sub'), false)
  await sbx.files.write('/work/fs/f.txt', 'x')
  const names = (await sbx.files.list('/work/fs')).map((e) => `${e.name}:${e.type}`).sort()
  assert.deepEqual(names, ['f.txt:file', 'sub:dir'])
  assert.equal(await sbx.files.exists('/work/fs/f.txt'), true)
  assert.equal(await sbx.files.exists('/work/fs/nope'), false)
  const moved = await sbx.files.rename('/work/fs/f.txt', '/work/fs/g.txt')
  assert.equal(moved.path, '/work/fs/g.txt')
  assert.equal(await sbx.files.exists('/work/fs/f.txt'), false)
  await sbx.files.remove('/work/fs')
  assert.equal(await sbx.files.exists('/work/fs'), false)
})

test('watchDir reports a file a command creates', async () => {
  await sbx.files.makeDir('/work/watched')
  const events = []
  let seen
  const found = new Promise((resolve) => { seen = resolve })
  const w = await sbx.files.watchDir('/work/watched', (ev) => {
    events.push(ev)
    if (ev.name.endsWith('made.txt')) seen()
  })
  try {
    await sbx.commands.run('echo x > made.txt', { cwd: '/work/watched' })
    await Promise.race([found, new Promise((_, rej) => setTimeout(() => rej(new Error(`no event: ${JSON.stringify(events)}`)), 20000))])
  } finally {
    await w.stop()
  }
})

// GET through kilnd's listener with the Host header getHost gives, as a
// client resolving that name to it would.
function portGet(host, path, headers = {}) {
  const api = new URL(process.env.E2B_API_URL)
  return new Promise((resolve, reject) => {
    const req = http.request({ host: api.hostname, port: api.port, path, headers: { ...headers, host } }, (res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.end()
  })
}

test('getHost reaches a web server in the sandbox; public by default', async () => {
  // The double's sandboxes are the host: its ports are the host's.
  const port = double ? 20000 + Math.floor(Math.random() * 40000) : 8000
  assert.equal(sbx.trafficAccessToken, undefined)
  await sbx.files.write('/work/www/index.html', 'served from the sandbox\n')
  await sbx.commands.run(`exec python3 -m http.server ${port} --bind 127.0.0.1`, { background: true, cwd: '/work/www' })
  const host = sbx.getHost(port)
  assert.ok(host.startsWith(`${port}-${sbx.sandboxId}.`), host)
  let r
  for (let i = 0; i < 240; i++) {
    r = await portGet(host, '/index.html')
    if (r.status === 200) break
    await new Promise((ok) => setTimeout(ok, 500))
  }
  assert.deepEqual(r, { status: 200, body: 'served from the sandbox\n' })
})
