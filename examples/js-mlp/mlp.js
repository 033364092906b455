// js-mlp: a tpubox guest in JavaScript.
//
// Reads a small CSV table (a header and 1 to 64 rows of three numbers) from its `--csv TEXT`
// argument, normalises each column to zero mean and unit variance in JavaScript, then runs a
// two-layer perceptron on the host's device:
//
//     y = relu(x · W1 + b1) · W2 + b2      x: f32[N,3], W1: f32[3,8], W2: f32[8,2]
//
// as a StableHLO program (MLIR text) written for the row count it read. It reads the result
// back, recomputes it in plain JavaScript and fails if the two differ by more than 1e-4.
//
// Output (stdout): `rows: N`, `normalized: [[...]]`, `result: [[y0, y1], ...]` (JSON rows) and
// `max abs diff: D`. On any error: one line `js-mlp: error: ...` on stderr, exit status 1.
//
// Resources: a tensor or executable handle owns device memory on the host. JavaScript frees a
// handle only when the garbage collector finalises it, which may be never in a short program,
// so this guest releases every handle explicitly with `handle[Symbol.dispose]()` as soon as it
// is done with it (see `using()` below).

import { Tensor } from 'tpubox:device/types@0.1.2';
import { compile, execute } from 'tpubox:device/client@0.1.2';
import { getArguments } from 'wasi:cli/environment@0.2.0';

const NAME = 'js-mlp';
const IN = 3, HIDDEN = 8, OUT = 2;
const MAX_ROWS = 64;
const TOLERANCE = 1e-4;

class Failure extends Error {}

// Accepts `[+-]digits[.digits][e[+-]digits]` (a leading or trailing dot is fine) and nothing
// else: no `NaN`, `Infinity`, hex, or empty fields, so every guest language reads the same
// numbers. (`Number('')` is 0 and `Number('0x10')` is 16, hence the check.)
const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/;

function parseCsv(text) {
  const lines = text.split(/\r?\n/).map((line, i) => [i + 1, line]).filter(([, l]) => l.trim() !== '');
  if (lines.length === 0) throw new Failure('empty input: expected a header line and at least one row');
  const [headerNo, header] = lines[0];
  const names = header.split(',').map((f) => f.trim());
  if (names.length !== IN) throw new Failure(`line ${headerNo}: header has ${names.length} columns, expected ${IN}`);
  const rows = [];
  for (const [no, line] of lines.slice(1)) {
    const fields = line.split(',').map((f) => f.trim());
    if (fields.length !== IN) throw new Failure(`line ${no}: expected ${IN} fields, got ${fields.length}`);
    rows.push(fields.map((field, c) => {
      if (!NUMBER.test(field)) throw new Failure(`line ${no}, column ${c + 1}: not a number: '${field}'`);
      const v = Number(field);
      if (!Number.isFinite(v)) throw new Failure(`line ${no}, column ${c + 1}: out of range: '${field}'`);
      return v;
    }));
  }
  if (rows.length === 0) throw new Failure('no data rows after the header');
  if (rows.length > MAX_ROWS) throw new Failure(`${rows.length} data rows, at most ${MAX_ROWS} allowed`);
  return { names, rows };
}

// Each column to zero mean and unit (population) variance, in double precision; a constant
// column becomes all zeros.
function normalise(rows) {
  const n = rows.length;
  const out = rows.map(() => new Array(IN).fill(0));
  for (let c = 0; c < IN; c++) {
    let total = 0;
    for (const r of rows) total += r[c];
    const mean = total / n;
    let sq = 0;
    for (const r of rows) sq += (r[c] - mean) * (r[c] - mean);
    const std = Math.sqrt(sq / n);
    rows.forEach((r, i) => { out[i][c] = std > 0 ? (r[c] - mean) / std : 0; });
  }
  return out;
}

// Deterministic weights: W1 f32[3,8], b1 f32[8], W2 f32[8,2], b2 f32[2] (row-major).
function weights() {
  const w1 = new Float32Array(IN * HIDDEN), b1 = new Float32Array(HIDDEN);
  const w2 = new Float32Array(HIDDEN * OUT), b2 = new Float32Array(OUT);
  for (let k = 0; k < IN; k++) for (let j = 0; j < HIDDEN; j++) w1[k * HIDDEN + j] = (((3 * k + 5 * j) % 11) - 5) / 8;
  for (let j = 0; j < HIDDEN; j++) b1[j] = ((j % 3) - 1) / 10;
  for (let j = 0; j < HIDDEN; j++) for (let m = 0; m < OUT; m++) w2[j * OUT + m] = (((7 * j + 3 * m) % 13) - 6) / 10;
  for (let m = 0; m < OUT; m++) b2[m] = 0.25 - 0.5 * m;
  return { w1, b1, w2, b2 };
}

// The MLP in StableHLO for `n` rows. HIGHEST precision keeps f32 matmuls in full f32 on
// backends that would otherwise use bf16 or TF32 passes.
function program(n) {
  const x = `tensor<${n}x${IN}xf32>`, h = `tensor<${n}x${HIDDEN}xf32>`, y = `tensor<${n}x${OUT}xf32>`;
  const w1 = `tensor<${IN}x${HIDDEN}xf32>`, w2 = `tensor<${HIDDEN}x${OUT}xf32>`;
  return `
module @js_mlp {
  func.func public @main(%x: ${x}, %w1: ${w1}, %b1: tensor<${HIDDEN}xf32>, %w2: ${w2}, %b2: tensor<${OUT}xf32>) -> ${y} {
    %xw = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (${x}, ${w1}) -> ${h}
    %bb1 = stablehlo.broadcast_in_dim %b1, dims = [1] : (tensor<${HIDDEN}xf32>) -> ${h}
    %z = stablehlo.add %xw, %bb1 : ${h}
    %zero = stablehlo.constant dense<0.0> : ${h}
    %a = stablehlo.maximum %z, %zero : ${h}
    %aw = stablehlo.dot_general %a, %w2, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (${h}, ${w2}) -> ${y}
    %bb2 = stablehlo.broadcast_in_dim %b2, dims = [1] : (tensor<${OUT}xf32>) -> ${y}
    %out = stablehlo.add %aw, %bb2 : ${y}
    func.return %out : ${y}
  }
}
`;
}

// The same MLP in plain JavaScript (double precision).
function reference(x, { w1, b1, w2, b2 }) {
  return x.map((row) => {
    const hidden = [];
    for (let j = 0; j < HIDDEN; j++) {
      let z = b1[j];
      for (let k = 0; k < IN; k++) z += row[k] * w1[k * HIDDEN + j];
      hidden.push(Math.max(z, 0));
    }
    const ys = [];
    for (let m = 0; m < OUT; m++) {
      let y = b2[m];
      for (let j = 0; j < HIDDEN; j++) y += hidden[j] * w2[j * OUT + m];
      ys.push(y);
    }
    return ys;
  });
}

// Calls a tpubox import; its `error` record arrives as an exception whose `payload` is
// `{ kind, message }`. Rethrows it as a one-line Failure naming the step.
function deviceCall(what, fn) {
  try {
    return fn();
  } catch (e) {
    const p = e && e.payload;
    if (p && typeof p.kind === 'string') throw new Failure(`${what}: ${p.kind}: ${p.message}`);
    throw e;
  }
}

function upload(values, dims) {
  const bytes = new Uint8Array(Float32Array.from(values).buffer);
  return deviceCall('upload', () => Tensor.fromBytes('f32', dims.map(BigInt), bytes, undefined));
}

// Runs `body(handle)` and then releases the handle at once, even when `body` throws. Without
// this, the host keeps the device memory until the JavaScript garbage collector runs.
function using(handle, body) {
  try {
    return body(handle);
  } finally {
    handle[Symbol.dispose]();
  }
}

const jsonRows = (rows) => '[' + rows.map((r) => '[' + r.map(String).join(',') + ']').join(',') + ']';

function main(argv) {
  if (argv.length !== 2 || argv[0] !== '--csv') {
    throw new Failure('usage: js-mlp --csv TEXT  (the CSV table as one argument)');
  }
  const { rows } = parseCsv(argv[1]);
  const x = normalise(rows).map((r) => Array.from(Float32Array.from(r)));
  const n = x.length;
  const w = weights();

  const code = new TextEncoder().encode(program(n));
  const got = using(deviceCall('compile', () => compile('mlir-text', code, { device: undefined })), (exe) =>
    using(upload(x.flat(), [n, IN]), (xt) =>
      using(upload(w.w1, [IN, HIDDEN]), (w1t) =>
        using(upload(w.b1, [HIDDEN]), (b1t) =>
          using(upload(w.w2, [HIDDEN, OUT]), (w2t) =>
            using(upload(w.b2, [OUT]), (b2t) => {
              const outs = deviceCall('execute', () => execute(exe, [xt, w1t, b1t, w2t, b2t], new Uint32Array(0)));
              try {
                if (outs.length !== 1) throw new Failure(`expected 1 result, got ${outs.length}`);
                const spec = outs[0].spec();
                const dims = Array.from(spec.dims, Number);
                if (spec.dtype !== 'f32' || dims.length !== 2 || dims[0] !== n || dims[1] !== OUT) {
                  throw new Failure(`result is ${spec.dtype}[${dims}], expected f32[${n},${OUT}]`);
                }
                const bytes = deviceCall('read', () => outs[0].read());
                const flat = new Float32Array(bytes.buffer, bytes.byteOffset, n * OUT);
                return x.map((_, i) => Array.from(flat.subarray(i * OUT, (i + 1) * OUT)));
              } finally {
                for (const t of outs) t[Symbol.dispose]();
              }
            }))))));

  const want = reference(x, w);
  let diff = 0;
  got.forEach((r, i) => r.forEach((v, m) => { diff = Math.max(diff, Math.abs(v - want[i][m])); }));
  if (!got.flat().every(Number.isFinite) || !(diff <= TOLERANCE)) {
    throw new Failure(`device result ${jsonRows(got)} differs from the JavaScript reference ${jsonRows(want)} by ${diff} (> ${TOLERANCE})`);
  }
  console.log(`rows: ${n}`);
  console.log(`normalized: ${jsonRows(x)}`);
  console.log(`result: ${jsonRows(got)}`);
  console.log(`max abs diff: ${diff}`);
}

// The `wasi:cli/run` export: returning normally is exit status 0, throwing is status 1.
export const run = {
  run() {
    try {
      main(getArguments().slice(1));
    } catch (e) {
      const msg = e instanceof Failure ? e.message : `internal: ${e}`;
      console.error(`${NAME}: error: ${msg}`);
      throw undefined;
    }
  },
};
