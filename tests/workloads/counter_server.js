// node counter_server.js ADDR: the "counter protocol" HTTP server of
// tests/tests/daemons.rs, in node (its event loop, libuv's thread pool, V8's
// threads and a worker thread). Run in the foreground as a systemd service
// would run it; stops cleanly on SIGTERM (exit 0).
//
//   GET /add/KEY/N  adds N to KEY, answers its new value
//   GET /sum        "KEYS TOTAL ADDS" over all keys
//   GET /check      "OK ..." if the server's own state is consistent: the
//                   values add up to the total, and the hash chains that a
//                   timer of the main thread and a worker thread extend
//                   recompute to the same digests; "FAIL ..." otherwise
'use strict';
const http = require('http');
const crypto = require('crypto');
const { Worker, isMainThread, parentPort } = require('worker_threads');

function step(hash, id, n) {
  return crypto.createHash('sha256').update(hash).update(`${id}/${n}`).digest();
}

function recompute(id, n) {
  let h = Buffer.alloc(32);
  for (let i = 1; i <= n; i++) h = step(h, id, i);
  return h;
}

if (!isMainThread) {
  // The worker's chain: a step every millisecond, reported every 10.
  let n = 0;
  let h = Buffer.alloc(32);
  setInterval(() => {
    n++;
    h = step(h, 1, n);
    if (n % 10 === 0) parentPort.postMessage({ n, h: h.toString('hex') });
  }, 1);
} else {
  const [host, port] = process.argv[2].split(':');
  const vals = new Map();
  let total = 0;
  let adds = 0;
  const mine = { n: 0, h: Buffer.alloc(32) };
  setInterval(() => {
    mine.n++;
    mine.h = step(mine.h, 0, mine.n);
  }, 1);
  let worker = { n: 0, h: Buffer.alloc(32).toString('hex') };
  const w = new Worker(__filename);
  w.on('message', (m) => { worker = m; });
  w.unref();

  const answer = (res, code, s) => {
    res.writeHead(code, { 'Content-Length': Buffer.byteLength(s) });
    res.end(s);
  };
  const check = () => {
    let sum = 0;
    for (const v of vals.values()) sum += v;
    if (sum !== total) return `FAIL values add up to ${sum}, total ${total}`;
    if (!recompute(0, mine.n).equals(mine.h)) return `FAIL main chain differs after ${mine.n} steps`;
    if (worker.n < 10) return 'FAIL the worker thread reported nothing';
    if (recompute(1, worker.n).toString('hex') !== worker.h) return `FAIL worker chain differs after ${worker.n} steps`;
    return `OK ${vals.size} keys, main chain ${mine.n} and worker chain ${worker.n} steps verified`;
  };
  const server = http.createServer((req, res) => {
    const p = req.url.split('/');
    if (p[1] === 'add' && p.length === 4 && /^-?\d+$/.test(p[3])) {
      const v = (vals.get(p[2]) || 0) + Number(p[3]);
      vals.set(p[2], v);
      total += Number(p[3]);
      adds++;
      answer(res, 200, String(v));
    } else if (req.url === '/sum') {
      answer(res, 200, `${vals.size} ${total} ${adds}`);
    } else if (req.url === '/check') {
      answer(res, 200, check());
    } else {
      answer(res, 400, 'bad path');
    }
  });
  // Clients keep their connections for the whole test.
  server.keepAliveTimeout = 0;
  server.requestTimeout = 0;
  server.headersTimeout = 0;
  server.listen(Number(port), host, () => console.log(`listening on ${host}:${port}`));
  process.on('SIGTERM', () => {
    server.close(() => {
      console.log('stopped');
      process.exit(0);
    });
    server.closeAllConnections();
  });
}
