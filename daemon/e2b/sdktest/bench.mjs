// Sandbox.create() + commands.run('true') through the unmodified E2B SDK:
// p50/p95 over N (50) at concurrency C (10), printed as JSON. Needs
// E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL; BENCH_N, BENCH_C and
// BENCH_TEMPLATE (base) change the run.
import { Sandbox } from 'e2b'

const n = Number(process.env.BENCH_N ?? 50)
const c = Number(process.env.BENCH_C ?? 10)
const template = process.env.BENCH_TEMPLATE ?? 'base'
// The SDK's request timeout (60 s by default): longer under emulated KVM,
// where ten creates at once queue behind each other.
const requestTimeoutMs = process.env.BENCH_REQUEST_TIMEOUT_MS ? Number(process.env.BENCH_REQUEST_TIMEOUT_MS) : undefined

function pct(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]
}

function summary(xs) {
  const s = [...xs].sort((a, b) => a - b)
  return { p50: pct(s, 50), p95: pct(s, 95), min: s[0], max: s[s.length - 1] }
}

const create = []
const run = []
const total = []
let failures = 0
let next = 0

async function one() {
  const t0 = performance.now()
  const sbx = await Sandbox.create(template, { timeoutMs: 600_000, requestTimeoutMs })
  const t1 = performance.now()
  try {
    // timeoutMs 0: no limit on the command (60 s by default) either.
    const r = await sbx.commands.run('true', { requestTimeoutMs, timeoutMs: requestTimeoutMs === undefined ? undefined : 0 })
    if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}`)
    const t2 = performance.now()
    create.push(t1 - t0)
    run.push(t2 - t1)
    total.push(t2 - t0)
  } finally {
    await sbx.kill()
  }
}

async function worker() {
  while (next < n) {
    next++
    try {
      await one()
    } catch (e) {
      failures++
      console.error(String(e))
    }
  }
}

const start = performance.now()
await Promise.all(Array.from({ length: Math.min(c, n) }, worker))
const wall = performance.now() - start
const ms = (o) => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, Math.round(v * 10) / 10]))
console.log(JSON.stringify({
  n, concurrency: c, template, ok: total.length, failures, wall_ms: Math.round(wall),
  create_ms: total.length ? ms(summary(create)) : null,
  run_ms: total.length ? ms(summary(run)) : null,
  total_ms: total.length ? ms(summary(total)) : null,
}, null, 2))
process.exit(failures ? 1 : 0)
