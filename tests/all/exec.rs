//! Integration tests for `tpubox exec`: StableHLO programs from `tests/programs/` run on the
//! default PJRT plugin (the installed CPU plugin), with every expected value computed here in
//! plain Rust — never copied from a program's output.
//!
//! Output files are checked by parsing the `.npy` header by hand (magic, `descr`, `shape`) and
//! comparing the data bytes, so the check does not depend on `tpubox_core::npy` being right.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use tpubox_core::exec::OutputInfo;
use tpubox_core::{DeviceService, PrimitiveType};

// ---------------------------------------------------------------------------------------------
// Shared device and helpers
// ---------------------------------------------------------------------------------------------

/// One PJRT client for the whole test binary (creating one costs ~100 ms and loads a large
/// plugin). `DeviceService` is `Send + Sync`; each test's runtime uses it.
fn device() -> Arc<DeviceService> {
    static DEVICE: OnceLock<Arc<DeviceService>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            tpubox_core::open_device(&tpubox_core::DeviceConfig::default())
                .expect("opening the default PJRT plugin (run `tpubox setup cpu`)")
        })
        .clone()
}

/// A session on `svc` for a tenant with the default limits, as `tpubox exec` makes.
fn session_on(svc: &Arc<DeviceService>) -> tpubox_core::Session {
    tpubox_core::Session::new(
        Arc::clone(svc),
        Arc::default(),
        tpubox_core::Tenant::new("exec-test", tpubox_core::TenantLimits::default()),
    )
}

fn session() -> tpubox_core::Session {
    session_on(&device())
}

fn program(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/programs")
        .join(name)
}

/// An input array: XLA type, dims and little-endian row-major bytes.
struct Input {
    ty: PrimitiveType,
    dims: Vec<i64>,
    data: Vec<u8>,
}

fn input(ty: PrimitiveType, dims: &[i64], data: Vec<u8>) -> Input {
    Input {
        ty,
        dims: dims.to_vec(),
        data,
    }
}

/// The result of one `exec` run: the temp dir (kept alive) and the output directory.
struct Ran {
    _dir: tempfile::TempDir,
    out: PathBuf,
    infos: Vec<OutputInfo>,
}

impl Ran {
    fn bytes(&self, i: usize) -> Vec<u8> {
        std::fs::read(self.out.join(format!("out{i}.npy"))).expect("reading an output file")
    }
}

/// Writes `inputs` as `.npy` files and returns their paths.
fn write_inputs(dir: &Path, inputs: &[Input]) -> Vec<PathBuf> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let p = dir.join(format!("in{i}.npy"));
            tpubox_core::npy::write_npy(&p, a.ty, &a.dims, &a.data).expect("writing an input");
            p
        })
        .collect()
}

async fn try_run(
    name: &str,
    inputs: &[Input],
) -> (tempfile::TempDir, anyhow::Result<Vec<OutputInfo>>) {
    let dir = tempfile::tempdir().unwrap();
    let args = write_inputs(dir.path(), inputs);
    let out = dir.path().join("out");
    let r = tpubox_core::exec::exec(&session(), &program(name), &args, &out).await;
    (dir, r)
}

async fn run(name: &str, inputs: &[Input]) -> Ran {
    let (dir, r) = try_run(name, inputs).await;
    let infos = r.unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let out = dir.path().join("out");
    // outputs.json must agree with the returned descriptions.
    let json = std::fs::read_to_string(out.join("outputs.json")).expect("outputs.json");
    let listed: Vec<OutputInfo> = serde_json::from_str(&json).expect("outputs.json parses");
    assert_eq!(
        listed, infos,
        "{name}: outputs.json differs from exec's result"
    );
    for (i, info) in infos.iter().enumerate() {
        assert_eq!(info.index, i);
        assert_eq!(info.file, format!("out{i}.npy"));
    }
    Ran {
        _dir: dir,
        out,
        infos,
    }
}

async fn expect_err(name: &str, inputs: &[Input]) -> String {
    let (_dir, r) = try_run(name, inputs).await;
    match r {
        Ok(infos) => panic!("{name}: expected an error, got outputs {infos:?}"),
        Err(e) => format!("{e:#}"),
    }
}

/// Per-type facts, written out independently of the library: XLA name, NumPy descr written by
/// tpubox, element size.
fn facts(ty: PrimitiveType) -> (&'static str, &'static str, usize) {
    use PrimitiveType::*;
    match ty {
        Pred => ("PRED", "|b1", 1),
        S8 => ("S8", "|i1", 1),
        S16 => ("S16", "<i2", 2),
        S32 => ("S32", "<i4", 4),
        S64 => ("S64", "<i8", 8),
        U8 => ("U8", "|u1", 1),
        U16 => ("U16", "<u2", 2),
        U32 => ("U32", "<u4", 4),
        U64 => ("U64", "<u8", 8),
        F16 => ("F16", "<f2", 2),
        Bf16 => ("BF16", "|V2", 2),
        F32 => ("F32", "<f4", 4),
        F64 => ("F64", "<f8", 8),
        C64 => ("C64", "<c8", 8),
        C128 => ("C128", "<c16", 16),
    }
}

/// Parses a `.npy` file by hand: returns (descr, shape, data bytes).
fn parse_npy(bytes: &[u8]) -> (String, Vec<i64>, Vec<u8>) {
    assert!(
        bytes.len() >= 10 && &bytes[..6] == b"\x93NUMPY",
        "not an .npy file"
    );
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => panic!("unknown .npy version {v}"),
    };
    let header = std::str::from_utf8(&bytes[start..start + hlen]).expect("ASCII header");
    let compact: String = header.chars().filter(|c| !c.is_whitespace()).collect();
    assert!(compact.contains("'fortran_order':False"), "header {header}");
    let descr = {
        let i = compact.find("'descr':'").expect("descr") + "'descr':'".len();
        let j = compact[i..].find('\'').unwrap();
        compact[i..i + j].to_string()
    };
    let shape = {
        let i = compact.find("'shape':(").expect("shape") + "'shape':(".len();
        let j = compact[i..].find(')').unwrap();
        compact[i..i + j]
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<i64>().unwrap())
            .collect()
    };
    (descr, shape, bytes[start + hlen..].to_vec())
}

/// Checks output `i` of `ran` exactly: dtype, dims, the `.npy` descr and shape, the data bytes.
fn check_exact(ran: &Ran, i: usize, ty: PrimitiveType, dims: &[i64], data: &[u8]) {
    let data_got = check_header(ran, i, ty, dims);
    assert_eq!(
        data_got,
        data,
        "output {i} ({}{dims:?}): data bytes differ",
        facts(ty).0
    );
}

/// Checks output `i`'s dtype, dims and header; returns its data bytes.
fn check_header(ran: &Ran, i: usize, ty: PrimitiveType, dims: &[i64]) -> Vec<u8> {
    let (name, descr, size) = facts(ty);
    let info = &ran.infos[i];
    assert_eq!(info.dtype, name, "output {i}: dtype");
    assert_eq!(info.dims, dims, "output {i}: dims");
    let (d, shape, data) = parse_npy(&ran.bytes(i));
    assert_eq!(d, descr, "output {i}: npy descr");
    assert_eq!(shape, dims, "output {i}: npy shape");
    let n: i64 = dims.iter().product();
    assert_eq!(data.len(), n as usize * size, "output {i}: data length");
    data
}

/// Float-aware comparison for floating and complex types: wherever the expected component is a
/// NaN the result need only be a NaN (payloads of computed NaNs are unspecified); everywhere
/// else the bit patterns must be equal (so -0.0 ≠ +0.0). Other types compare bytes exactly.
fn check_values(ran: &Ran, i: usize, ty: PrimitiveType, dims: &[i64], want: &[u8]) {
    let got = check_header(ran, i, ty, dims);
    assert_eq!(got.len(), want.len());
    let comp = match ty {
        PrimitiveType::F16 | PrimitiveType::Bf16 => 2,
        PrimitiveType::F32 | PrimitiveType::C64 => 4,
        PrimitiveType::F64 | PrimitiveType::C128 => 8,
        _ => {
            assert_eq!(got, want, "output {i} ({}): data bytes differ", facts(ty).0);
            return;
        }
    };
    let is_nan = |b: &[u8]| match ty {
        PrimitiveType::F16 => f16::from_le_bytes([b[0], b[1]]).is_nan(),
        PrimitiveType::Bf16 => bf16::from_le_bytes([b[0], b[1]]).is_nan(),
        PrimitiveType::F32 | PrimitiveType::C64 => {
            f32::from_le_bytes(b.try_into().unwrap()).is_nan()
        }
        _ => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
    };
    let is_subnormal = |b: &[u8]| match ty {
        PrimitiveType::F16 => {
            f16::from_le_bytes([b[0], b[1]]).classify() == std::num::FpCategory::Subnormal
        }
        PrimitiveType::Bf16 => {
            bf16::from_le_bytes([b[0], b[1]]).classify() == std::num::FpCategory::Subnormal
        }
        PrimitiveType::F32 | PrimitiveType::C64 => {
            f32::from_le_bytes(b.try_into().unwrap()).is_subnormal()
        }
        _ => f64::from_le_bytes(b.try_into().unwrap()).is_subnormal(),
    };
    // A zero with the sign of `w`: every bit clear except possibly the sign (top bit, LE).
    let same_sign_zero = |g: &[u8], w: &[u8]| {
        let last = g.len() - 1;
        g[..last].iter().all(|&x| x == 0) && g[last] & 0x7f == 0 && g[last] == w[last] & 0x80
    };
    for (k, (g, w)) in got.chunks(comp).zip(want.chunks(comp)).enumerate() {
        if is_nan(w) {
            assert!(
                is_nan(g),
                "output {i} ({}): component {k} should be NaN, got {g:02x?}",
                facts(ty).0
            );
        } else if is_subnormal(w) {
            // XLA:CPU computes with subnormals flushed to zero (FTZ/DAZ): f32, f64, complex,
            // and bf16 (computed in f32) give a zero of the same sign. IEEE results pass too.
            assert!(
                g == w || same_sign_zero(g, w),
                "output {i} ({}): component {k}: got {g:02x?}, want {w:02x?} or a signed zero",
                facts(ty).0
            );
        } else {
            assert_eq!(g, w, "output {i} ({}): component {k} differs", facts(ty).0);
        }
    }
}

/// Little-endian encoding of test values.
trait Le: Copy {
    fn put(self, out: &mut Vec<u8>);
}
macro_rules! le_impl {
    ($($t:ty),*) => {$(
        impl Le for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
le_impl!(i8, i16, i32, i64, u8, u16, u32, u64, f32, f64, f16, bf16);
impl Le for bool {
    fn put(self, out: &mut Vec<u8>) {
        out.push(u8::from(self));
    }
}
impl<T: Le> Le for (T, T) {
    fn put(self, out: &mut Vec<u8>) {
        self.0.put(out);
        self.1.put(out);
    }
}
fn le<T: Le>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::new();
    for &x in v {
        x.put(&mut out);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// 1. Every XLA element type round-trips exactly, and one real op per type computes right
// ---------------------------------------------------------------------------------------------

/// One dtype program: inputs `a`, `b` (both [2,3]) and the expected outputs.
struct DtypeCase {
    ty: PrimitiveType,
    a: Vec<u8>,
    b: Vec<u8>,
    /// Expected outputs after the identity one (which must equal `a` bit for bit).
    ops: Vec<Vec<u8>>,
}

macro_rules! signed_case {
    ($t:ty, $pt:expr) => {{
        let a: [$t; 6] = [<$t>::MIN, <$t>::MAX, -1, 0, 1, 42];
        let b: [$t; 6] = [-1, 1, -1, 0, <$t>::MAX, 7];
        // XLA integer arithmetic is two's complement: overflow wraps, -MIN == MIN.
        let sum: Vec<$t> = a.iter().zip(&b).map(|(x, y)| x.wrapping_add(*y)).collect();
        let neg: Vec<$t> = a.iter().map(|x| x.wrapping_neg()).collect();
        DtypeCase {
            ty: $pt,
            a: le(&a),
            b: le(&b),
            ops: vec![le(&sum), le(&neg)],
        }
    }};
}

macro_rules! unsigned_case {
    ($t:ty, $pt:expr) => {{
        let half = <$t>::MAX / 2;
        let a: [$t; 6] = [0, <$t>::MAX, 1, half, 2, 200];
        let b: [$t; 6] = [0, 1, <$t>::MAX, half + 1, 3, 55];
        let sum: Vec<$t> = a.iter().zip(&b).map(|(x, y)| x.wrapping_add(*y)).collect();
        DtypeCase {
            ty: $pt,
            a: le(&a),
            b: le(&b),
            ops: vec![le(&sum)],
        }
    }};
}

macro_rules! float_case {
    ($t:ty, $pt:expr, $nan_bits:expr, $sub_bits:expr, $one:expr, $two_half:expr, $zero:expr) => {{
        // A NaN with a payload, ±inf, -0.0, the smallest subnormal, MAX.
        let a: [$t; 6] = [
            <$t>::from_bits($nan_bits),
            <$t>::INFINITY,
            -$zero,
            <$t>::NEG_INFINITY,
            <$t>::from_bits($sub_bits),
            <$t>::MAX,
        ];
        let b: [$t; 6] = [$one, $one, $zero, $two_half, $zero, $one];
        let sum: Vec<$t> = a.iter().zip(&b).map(|(x, y)| *x + *y).collect();
        let neg: Vec<$t> = a.iter().map(|x| -*x).collect();
        DtypeCase {
            ty: $pt,
            a: le(&a),
            b: le(&b),
            ops: vec![le(&sum), le(&neg)],
        }
    }};
}

macro_rules! complex_case {
    ($t:ty, $pt:expr) => {{
        let a: [($t, $t); 6] = [
            (<$t>::NAN, 1.0),
            (<$t>::INFINITY, -0.0),
            (-0.0, <$t>::NEG_INFINITY),
            (1.5, -2.25),
            (<$t>::MAX, <$t>::from_bits(1)),
            (0.0, 3.0),
        ];
        let b: [($t, $t); 6] = [
            (1.0, 1.0),
            (1.0, 0.0),
            (0.0, 0.0),
            (0.5, 0.25),
            (<$t>::MAX, 0.0),
            (-1.0, -3.0),
        ];
        let sum: Vec<($t, $t)> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x.0 + y.0, x.1 + y.1))
            .collect();
        let neg: Vec<($t, $t)> = a.iter().map(|x| (-x.0, -x.1)).collect();
        DtypeCase {
            ty: $pt,
            a: le(&a),
            b: le(&b),
            ops: vec![le(&sum), le(&neg)],
        }
    }};
}

fn pred_case() -> DtypeCase {
    let a = [false, false, true, true, true, false];
    let b = [false, true, false, true, true, true];
    let not: Vec<bool> = a.iter().map(|x| !x).collect();
    let and: Vec<bool> = a.iter().zip(&b).map(|(x, y)| *x && *y).collect();
    let or: Vec<bool> = a.iter().zip(&b).map(|(x, y)| *x || *y).collect();
    DtypeCase {
        ty: PrimitiveType::Pred,
        a: le(&a),
        b: le(&b),
        ops: vec![le(&not), le(&and), le(&or)],
    }
}

fn dtype_case(ty: PrimitiveType) -> DtypeCase {
    use PrimitiveType::*;
    match ty {
        Pred => pred_case(),
        S8 => signed_case!(i8, S8),
        S16 => signed_case!(i16, S16),
        S32 => signed_case!(i32, S32),
        S64 => signed_case!(i64, S64),
        U8 => unsigned_case!(u8, U8),
        U16 => unsigned_case!(u16, U16),
        U32 => unsigned_case!(u32, U32),
        U64 => unsigned_case!(u64, U64),
        F16 => float_case!(f16, F16, 0x7e01, 1, f16::ONE, f16::from_f32(2.5), f16::ZERO),
        Bf16 => float_case!(
            bf16,
            Bf16,
            0x7fc1,
            1,
            bf16::ONE,
            bf16::from_f32(2.5),
            bf16::ZERO
        ),
        F32 => float_case!(f32, F32, 0x7fc0_0001, 1, 1.0, 2.5, 0.0),
        F64 => float_case!(f64, F64, 0x7ff8_0000_0000_0001, 1, 1.0, 2.5, 0.0),
        C64 => complex_case!(f32, C64),
        C128 => complex_case!(f64, C128),
    }
}

async fn run_dtype(ty: PrimitiveType) {
    let case = dtype_case(ty);
    assert_eq!(case.ty, ty);
    assert_eq!(case.a.len(), 6 * facts(ty).2);
    let file = format!("dtype_{}.mlir", facts(ty).0.to_lowercase());
    let ran = run(
        &file,
        &[
            input(ty, &[2, 3], case.a.clone()),
            input(ty, &[2, 3], case.b.clone()),
        ],
    )
    .await;
    assert_eq!(
        ran.infos.len(),
        1 + case.ops.len(),
        "{file}: number of outputs"
    );
    // Output 0 returns the argument: bit-exact, NaN payloads and subnormals included.
    check_exact(&ran, 0, ty, &[2, 3], &case.a);
    for (k, want) in case.ops.iter().enumerate() {
        check_values(&ran, k + 1, ty, &[2, 3], want);
    }
}

macro_rules! dtype_tests {
    ($($name:ident: $ty:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $name() {
            run_dtype(PrimitiveType::$ty).await;
        }
    )*};
}

dtype_tests! {
    dtype_pred: Pred,
    dtype_s8: S8,
    dtype_s16: S16,
    dtype_s32: S32,
    dtype_s64: S64,
    dtype_u8: U8,
    dtype_u16: U16,
    dtype_u32: U32,
    dtype_u64: U64,
    dtype_f16: F16,
    dtype_bf16: Bf16,
    dtype_f32: F32,
    dtype_f64: F64,
    dtype_c64: C64,
    dtype_c128: C128,
}

#[test]
fn type_table_matches_library() {
    assert_eq!(PrimitiveType::ALL.len(), 15);
    for ty in PrimitiveType::ALL {
        let (name, descr, size) = facts(ty);
        assert_eq!(ty.name(), name);
        assert_eq!(ty.byte_size(), size, "{name}");
        assert_eq!(tpubox_core::npy::numpy_descr(ty), descr, "{name}");
    }
}

/// All 15 types through one program with 15 parameters and 15 results.
#[tokio::test]
async fn identity_all_types() {
    let inputs: Vec<Input> = PrimitiveType::ALL
        .iter()
        .map(|&ty| input(ty, &[2, 3], dtype_case(ty).a))
        .collect();
    // The program's parameter order is the order of PrimitiveType::ALL.
    let order = [
        "PRED", "S8", "S16", "S32", "S64", "U8", "U16", "U32", "U64", "F16", "BF16", "F32", "F64",
        "C64", "C128",
    ];
    let names: Vec<&str> = PrimitiveType::ALL.iter().map(|&t| facts(t).0).collect();
    assert_eq!(names, order);
    let ran = run("identity_all.mlir", &inputs).await;
    assert_eq!(ran.infos.len(), 15);
    for (i, a) in inputs.iter().enumerate() {
        check_exact(&ran, i, a.ty, &[2, 3], &a.data);
    }
}

/// BF16 travels as raw `|V2` records in both directions, and a typed file is refused for it.
#[tokio::test]
async fn bf16_is_raw_v2() {
    let case = dtype_case(PrimitiveType::Bf16);
    let ran = run(
        "dtype_bf16.mlir",
        &[
            input(PrimitiveType::Bf16, &[2, 3], case.a.clone()),
            input(PrimitiveType::Bf16, &[2, 3], case.b.clone()),
        ],
    )
    .await;
    let text = String::from_utf8_lossy(&ran.bytes(0)).into_owned();
    assert!(text.contains("'|V2'"), "bf16 header: {text}");
    // An <f2 (F16) file where BF16 is expected is an error, not a reinterpretation.
    let msg = expect_err(
        "dtype_bf16.mlir",
        &[
            input(PrimitiveType::F16, &[2, 3], case.a.clone()),
            input(PrimitiveType::Bf16, &[2, 3], case.b.clone()),
        ],
    )
    .await;
    assert!(msg.contains("BF16"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// 2. Several results: different dtypes and ranks, a scalar, a zero-size array
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn multiple_outputs_scalar_and_empty() {
    let a: [f32; 6] = [0.5, 1.5, -2.0, 4.0, 8.25, -0.75];
    let ran = run(
        "multi_out.mlir",
        &[input(PrimitiveType::F32, &[2, 3], le(&a))],
    )
    .await;
    assert_eq!(ran.infos.len(), 4);
    // Every partial sum of these values is exact in f32, so the order of the reduction is moot.
    let sum: f32 = a.iter().sum();
    assert_eq!(sum, 11.5);
    check_exact(&ran, 0, PrimitiveType::F32, &[], &le(&[sum]));
    check_exact(&ran, 1, PrimitiveType::F32, &[0, 3], &[]);
    let iota: Vec<i64> = (0..3).flat_map(|i| [i, i]).collect();
    check_exact(&ran, 2, PrimitiveType::S64, &[3, 2], &le(&iota));
    let sq: Vec<f64> = a.iter().map(|&x| f64::from(x) * f64::from(x)).collect();
    check_exact(&ran, 3, PrimitiveType::F64, &[2, 3], &le(&sq));
}

/// A function returning a `tuple<...>` value: the CPU plugin (StableHLO 1.20) accepts it and the
/// tuple comes back flattened into one output per element.
#[tokio::test]
async fn tuple_result_is_flattened() {
    let a: [f32; 2] = [1.25, -3.5];
    let b: [i32; 3] = [7, i32::MIN, -1];
    let ran = run(
        "tuple_result.mlir",
        &[
            input(PrimitiveType::F32, &[2], le(&a)),
            input(PrimitiveType::S32, &[3], le(&b)),
        ],
    )
    .await;
    assert_eq!(ran.infos.len(), 2, "{:?}", ran.infos);
    check_exact(&ran, 0, PrimitiveType::F32, &[2], &le(&a));
    check_exact(&ran, 1, PrimitiveType::S32, &[3], &le(&b));
}

// ---------------------------------------------------------------------------------------------
// 3. Programs with arguments, checked against plain-Rust reference computations
// ---------------------------------------------------------------------------------------------

fn matmul_inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = (0..6).map(|i| 0.25 * i as f32 - 0.6).collect();
    let w: Vec<f32> = (0..12).map(|i| ((i * 7) % 5) as f32 * 0.3 - 0.45).collect();
    let b: Vec<f32> = vec![0.1, -0.2, 0.3, -0.4];
    (x, w, b)
}

fn matmul_reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0f32; 8];
    for i in 0..2 {
        for j in 0..4 {
            let mut acc = 0.0f64;
            for k in 0..3 {
                acc += f64::from(x[i * 3 + k]) * f64::from(w[k * 4 + j]);
            }
            y[i * 4 + j] = (acc + f64::from(b[j])) as f32;
        }
    }
    y
}

fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {k}: got {g}, want {w}");
    }
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test]
async fn matmul_with_bias() {
    let (x, w, b) = matmul_inputs();
    let ran = run(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    )
    .await;
    assert_eq!(ran.infos.len(), 1);
    let data = check_header(&ran, 0, PrimitiveType::F32, &[2, 4]);
    assert_close(&f32s(&data), &matmul_reference(&x, &w, &b), 1e-5);
}

#[tokio::test]
async fn reduce_sum_s32() {
    let a: Vec<i32> = (0..12)
        .map(|i| i * 1_000_003 - 5_000_000 + if i % 3 == 0 { -7 } else { 11 })
        .collect();
    let ran = run(
        "reduce_sum_s32.mlir",
        &[input(PrimitiveType::S32, &[3, 4], le(&a))],
    )
    .await;
    let rows: Vec<i32> = (0..3).map(|i| (0..4).map(|j| a[i * 4 + j]).sum()).collect();
    let cols: Vec<i32> = (0..4).map(|j| (0..3).map(|i| a[i * 4 + j]).sum()).collect();
    check_exact(&ran, 0, PrimitiveType::S32, &[3], &le(&rows));
    check_exact(&ran, 1, PrimitiveType::S32, &[4], &le(&cols));
}

#[tokio::test]
async fn convert_f32_to_s32_bf16_f16() {
    // 1 + 2^-8 and 1 + 3·2^-8 are ties for bf16 (round to even: down, up); 65520 is the f16 tie
    // between MAX and overflow (rounds to +inf); -25000.7 needs rounding in both.
    let a: [f32; 6] = [
        1.9,
        -1.9,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        -25000.7,
        65520.0,
    ];
    let ran = run("convert.mlir", &[input(PrimitiveType::F32, &[6], le(&a))]).await;
    let ints: Vec<i32> = a.iter().map(|&x| x.trunc() as i32).collect();
    assert_eq!(ints, [1, -1, 1, 1, -25000, 65520]);
    let b16: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(b16[2].to_bits(), 0x3f80, "tie rounds down to even");
    assert_eq!(b16[3].to_bits(), 0x3f82, "tie rounds up to even");
    let h16: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
    assert_eq!(h16[5], f16::INFINITY);
    check_exact(&ran, 0, PrimitiveType::S32, &[6], &le(&ints));
    check_exact(&ran, 1, PrimitiveType::Bf16, &[6], &le(&b16));
    check_exact(&ran, 2, PrimitiveType::F16, &[6], &le(&h16));
}

#[tokio::test]
async fn compare_and_select() {
    let a: [f32; 6] = [1.0, -2.0, f32::NAN, 3.0, -0.0, 5.0];
    let b: [f32; 6] = [0.0, -1.0, 1.0, 3.0, 0.0, f32::INFINITY];
    let ran = run(
        "compare_select.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&a)),
            input(PrimitiveType::F32, &[2, 3], le(&b)),
        ],
    )
    .await;
    let mask: Vec<bool> = a.iter().zip(&b).map(|(x, y)| x > y).collect();
    assert_eq!(mask, [true, false, false, false, false, false]);
    let sel: Vec<f32> = mask
        .iter()
        .zip(a.iter().zip(&b))
        .map(|(&m, (&x, &y))| if m { x } else { y })
        .collect();
    check_exact(&ran, 0, PrimitiveType::Pred, &[2, 3], &le(&mask));
    check_exact(&ran, 1, PrimitiveType::F32, &[2, 3], &le(&sel));
}

async fn iota_program_works() {
    let ran = run("iota.mlir", &[]).await;
    let a: Vec<i32> = (0..2).flat_map(|_| 0..3).collect();
    let b: Vec<f32> = (0..4).flat_map(|i| [i as f32, i as f32]).collect();
    check_exact(&ran, 0, PrimitiveType::S32, &[2, 3], &le(&a));
    check_exact(&ran, 1, PrimitiveType::F32, &[4, 2], &le(&b));
}

#[tokio::test]
async fn iota_without_parameters() {
    iota_program_works().await;
}

#[tokio::test]
async fn transpose_and_reshape() {
    let a: Vec<i32> = (0..6).map(|k| 10 * (k / 3) + k % 3 - 4).collect();
    let ran = run(
        "transpose_reshape.mlir",
        &[input(PrimitiveType::S32, &[2, 3], le(&a))],
    )
    .await;
    let mut t = vec![0i32; 6];
    for i in 0..2 {
        for j in 0..3 {
            t[j * 2 + i] = a[i * 3 + j];
        }
    }
    check_exact(&ran, 0, PrimitiveType::S32, &[3, 2], &le(&t));
    check_exact(&ran, 1, PrimitiveType::S32, &[3, 2], &le(&a));
    check_exact(&ran, 2, PrimitiveType::S32, &[6], &le(&a));
}

#[tokio::test]
async fn concatenate_and_slice() {
    let a: Vec<f32> = (0..6).map(|k| k as f32 + 0.5).collect();
    let b: Vec<f32> = vec![-1.0, -2.0, -3.0];
    let ran = run(
        "concat_slice.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&a)),
            input(PrimitiveType::F32, &[1, 3], le(&b)),
        ],
    )
    .await;
    let c: Vec<f32> = a.iter().chain(&b).copied().collect();
    let mut s = Vec::new();
    for i in 1..3 {
        for j in (0..3).step_by(2) {
            s.push(c[i * 3 + j]);
        }
    }
    assert_eq!(s, [3.5, 5.5, -1.0, -3.0]);
    check_exact(&ran, 0, PrimitiveType::F32, &[3, 3], &le(&c));
    check_exact(&ran, 1, PrimitiveType::F32, &[2, 2], &le(&s));
}

/// Several executions at once on the shared device give the same, right answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs() {
    let mut tasks = Vec::new();
    for n in 0..6 {
        tasks.push(tokio::spawn(async move {
            let (mut x, w, b) = matmul_inputs();
            x.iter_mut().for_each(|v| *v += n as f32);
            let ran = run(
                "matmul_bias.mlir",
                &[
                    input(PrimitiveType::F32, &[2, 3], le(&x)),
                    input(PrimitiveType::F32, &[3, 4], le(&w)),
                    input(PrimitiveType::F32, &[4], le(&b)),
                ],
            )
            .await;
            let data = check_header(&ran, 0, PrimitiveType::F32, &[2, 4]);
            assert_close(&f32s(&data), &matmul_reference(&x, &w, &b), 1e-4);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The command line
// ---------------------------------------------------------------------------------------------

fn tpubox_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tpubox"))
}

#[test]
fn cli_exec_matmul() {
    let dir = tempfile::tempdir().unwrap();
    let (x, w, b) = matmul_inputs();
    let args = write_inputs(
        dir.path(),
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    );
    let out = dir.path().join("result");
    let o = tpubox_cmd()
        .arg("exec")
        .arg(program("matmul_bias.mlir"))
        .args(args.iter().flat_map(|a| [Path::new("--arg"), a.as_path()]))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "status {:?}\nstdout {stdout}\nstderr {stderr}",
        o.status
    );
    assert!(stdout.contains("out0.npy"), "stdout: {stdout}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("outputs.json")).unwrap()).unwrap();
    let list = json.as_array().expect("outputs.json is a list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["index"], 0);
    assert_eq!(list[0]["file"], "out0.npy");
    assert_eq!(list[0]["dtype"], "F32");
    assert_eq!(list[0]["dims"], serde_json::json!([2, 4]));

    let arr = tpubox_core::npy::read_npy(&out.join("out0.npy"), None).unwrap();
    assert_eq!(arr.ty, PrimitiveType::F32);
    assert_eq!(arr.dims, [2, 4]);
    assert_close(&f32s(&arr.data), &matmul_reference(&x, &w, &b), 1e-5);
}

#[test]
fn cli_exec_scalar_and_empty_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let a: [f32; 6] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let args = write_inputs(dir.path(), &[input(PrimitiveType::F32, &[2, 3], le(&a))]);
    let out = dir.path().join("o");
    let o = tpubox_cmd()
        .arg("exec")
        .arg(program("multi_out.mlir"))
        .arg("--arg")
        .arg(&args[0])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "stderr {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("outputs.json")).unwrap()).unwrap();
    let got: Vec<(String, serde_json::Value)> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["dtype"].as_str().unwrap().to_string(), e["dims"].clone()))
        .collect();
    let want = [
        ("F32", serde_json::json!([])),
        ("F32", serde_json::json!([0, 3])),
        ("S64", serde_json::json!([3, 2])),
        ("F64", serde_json::json!([2, 3])),
    ];
    assert_eq!(got.len(), want.len());
    for ((gd, gdims), (wd, wdims)) in got.iter().zip(&want) {
        assert_eq!(gd, wd);
        assert_eq!(gdims, wdims);
    }
    let (descr, shape, data) = parse_npy(&std::fs::read(out.join("out0.npy")).unwrap());
    assert_eq!((descr.as_str(), shape.as_slice()), ("<f4", &[][..]));
    assert_eq!(data, 21.0f32.to_le_bytes());
}

/// A failing `tpubox exec` exits non-zero and says why in one `tpubox: ...` line on stderr.
fn assert_cli_fails(args: &[&std::ffi::OsStr], needle: &str) -> String {
    let o = tpubox_cmd().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "expected failure; stderr {stderr}");
    assert_eq!(o.status.code(), Some(2), "stderr {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let ours: Vec<&&str> = lines.iter().filter(|l| l.starts_with("tpubox: ")).collect();
    assert_eq!(
        ours.len(),
        1,
        "one `tpubox:` line expected; stderr:\n{stderr}"
    );
    assert!(ours[0].contains(needle), "stderr:\n{stderr}");
    stderr
}

#[test]
fn cli_wrong_arg_count_fails_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _, _) = matmul_inputs();
    let args = write_inputs(dir.path(), &[input(PrimitiveType::F32, &[2, 3], le(&x))]);
    let prog = program("matmul_bias.mlir");
    let out = dir.path().join("o");
    let stderr = assert_cli_fails(
        &[
            "exec".as_ref(),
            prog.as_os_str(),
            "--arg".as_ref(),
            args[0].as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        "takes 3 argument(s)",
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr:\n{stderr}");
    assert!(!out.join("outputs.json").exists());
}

#[test]
fn cli_compile_failure_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let prog = program("bad_syntax.mlir");
    let out = dir.path().join("o");
    assert_cli_fails(
        &[
            "exec".as_ref(),
            prog.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        "bad_syntax.mlir",
    );
}

#[test]
fn cli_a_dynamic_dimension_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let prog = dir.path().join("dyn.mlir");
    std::fs::write(
        &prog,
        "func.func public @main(%x: tensor<?x4xf32>) -> tensor<?x4xf32> {\n  %y = stablehlo.add %x, %x : tensor<?x4xf32>\n  return %y : tensor<?x4xf32>\n}\n",
    )
    .unwrap();
    let args = write_inputs(
        dir.path(),
        &[input(PrimitiveType::F32, &[3, 4], vec![0; 48])],
    );
    let out = dir.path().join("o");
    let mut cli: Vec<&std::ffi::OsStr> = vec!["exec".as_ref(), prog.as_os_str()];
    for a in &args {
        cli.push("--arg".as_ref());
        cli.push(a.as_os_str());
    }
    cli.push("--out".as_ref());
    cli.push(out.as_os_str());
    assert_cli_fails(
        &cli,
        "parameter 0 of `main` has a dimension of unknown size (f32[?,4])",
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Errors through the library
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn wrong_argument_count_names_the_parameters() {
    let (x, w, _) = matmul_inputs();
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
        ],
    )
    .await;
    assert!(msg.contains("takes 3 argument(s)"), "{msg}");
    assert!(msg.contains("f32[2,3], f32[3,4], f32[4]"), "{msg}");
    assert!(msg.contains("got 2"), "{msg}");
    // Too many is refused as well.
    let (x, w, b) = matmul_inputs();
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    )
    .await;
    assert!(msg.contains("got 4"), "{msg}");
}

#[tokio::test]
async fn wrong_dtype_is_refused() {
    let (x, w, b) = matmul_inputs();
    let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F64, &[2, 3], le(&x64)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    )
    .await;
    assert!(msg.contains("F32"), "names the expected dtype: {msg}");
    assert!(
        msg.contains("F64") || msg.contains("f8"),
        "names the given dtype: {msg}"
    );
    assert!(msg.contains("in0.npy"), "names the file: {msg}");
    // A same-size integer array is no substitute either.
    let xi: Vec<i32> = x.iter().map(|&v| v as i32).collect();
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::S32, &[2, 3], le(&xi)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    )
    .await;
    assert!(msg.contains("F32"), "{msg}");
}

#[tokio::test]
async fn wrong_dims_are_refused() {
    let (x, w, b) = matmul_inputs();
    // Same element count, transposed shape.
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[3, 2], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[4], le(&b)),
        ],
    )
    .await;
    assert!(msg.contains("f32[2,3]"), "names the expected spec: {msg}");
    assert!(msg.contains("f32[3,2]"), "names the given spec: {msg}");
    // Wrong rank on the last parameter.
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[1, 4], le(&b)),
        ],
    )
    .await;
    assert!(msg.contains("f32[4]") && msg.contains("f32[1,4]"), "{msg}");
    // A scalar where a vector is expected.
    let msg = expect_err(
        "matmul_bias.mlir",
        &[
            input(PrimitiveType::F32, &[2, 3], le(&x)),
            input(PrimitiveType::F32, &[3, 4], le(&w)),
            input(PrimitiveType::F32, &[], le(&[1.0f32])),
        ],
    )
    .await;
    assert!(msg.contains("f32[4]") && msg.contains("f32[]"), "{msg}");
}

#[tokio::test]
async fn compile_failures_are_errors() {
    for name in ["bad_syntax.mlir", "bad_types.mlir"] {
        let msg = expect_err(name, &[]).await;
        assert!(msg.contains(name), "names the program: {msg}");
        assert!(
            msg.to_lowercase().contains("compil"),
            "says it failed to compile: {msg}"
        );
    }
    // The device is still usable afterwards.
    iota_program_works().await;
}

#[tokio::test]
async fn unreadable_inputs_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o");
    let svc = device();
    // Missing program.
    let e = tpubox_core::exec::exec(&session_on(&svc), &dir.path().join("nope.mlir"), &[], &out)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("nope.mlir"), "{e:#}");
    // Empty program.
    let empty = dir.path().join("empty.mlir");
    std::fs::write(&empty, b"").unwrap();
    let e = tpubox_core::exec::exec(&session_on(&svc), &empty, &[], &out)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("empty"), "{e:#}");
    // Missing argument file.
    let missing = dir.path().join("missing.npy");
    let e = tpubox_core::exec::exec(
        &session_on(&svc),
        &program("concat_slice.mlir"),
        &[missing.clone(), missing],
        &out,
    )
    .await
    .unwrap_err();
    assert!(format!("{e:#}").contains("missing.npy"), "{e:#}");
    // An argument that is not an .npy file.
    let junk = dir.path().join("junk.npy");
    std::fs::write(&junk, b"definitely not numpy").unwrap();
    let e = tpubox_core::exec::exec(
        &session_on(&svc),
        &program("transpose_reshape.mlir"),
        &[junk],
        &out,
    )
    .await
    .unwrap_err();
    assert!(format!("{e:#}").contains("junk.npy"), "{e:#}");
    // A truncated .npy file.
    let good = tpubox_core::npy::to_npy_bytes(PrimitiveType::S32, &[2, 3], &[0u8; 24]).unwrap();
    let cut = dir.path().join("cut.npy");
    std::fs::write(&cut, &good[..good.len() - 5]).unwrap();
    let e = tpubox_core::exec::exec(
        &session_on(&svc),
        &program("transpose_reshape.mlir"),
        &[cut],
        &out,
    )
    .await
    .unwrap_err();
    assert!(format!("{e:#}").contains("cut.npy"), "{e:#}");
    assert!(!out.join("outputs.json").exists());
}

// ---------------------------------------------------------------------------------------------
// 5. Programs of several devices (issue 45): the module declares its partitions
// ---------------------------------------------------------------------------------------------

/// `a` split by rows over 4 devices, `b` replicated (GSPMD, as `jax.export` writes it with
/// Shardy off); returns `a + b` (split by rows) and the sum of `a` (replicated).
const GSPMD4: &str = include_str!("../programs/spmd_gspmd4.mlir");

/// `shard_map(psum)` as Shardy writes it: each device sums the four row blocks of `x`.
const PSUM4: &str = include_str!("../programs/spmd_psum4.mlir");

fn four() -> Arc<DeviceService> {
    crate::support::four_devices()
}

fn iota_f32(n: usize, base: f32) -> Vec<f32> {
    (0..n).map(|i| base + i as f32).collect()
}

/// Writes `text` as `name` and the arrays as .npy files under `dir`.
fn spmd_files(
    dir: &Path,
    name: &str,
    text: &str,
    arrays: &[(&[i64], &[f32])],
) -> (PathBuf, Vec<PathBuf>) {
    let prog = dir.join(name);
    std::fs::write(&prog, text).unwrap();
    let inputs: Vec<Input> = arrays
        .iter()
        .map(|(dims, v)| input(PrimitiveType::F32, dims, le(v)))
        .collect();
    (prog, write_inputs(dir, &inputs))
}

fn device_error(e: &anyhow::Error) -> &tpubox_core::DeviceError {
    e.downcast_ref::<tpubox_core::DeviceError>()
        .unwrap_or_else(|| panic!("not a DeviceError: {e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spmd_program_runs_on_every_device_its_module_declares() {
    let dir = tempfile::tempdir().unwrap();
    let a = iota_f32(24, 0.0);
    let b = iota_f32(24, 100.0);
    let (prog, args) = spmd_files(
        dir.path(),
        "gspmd.mlir",
        GSPMD4,
        &[(&[8, 3], &a), (&[8, 3], &b)],
    );
    let out = dir.path().join("out");
    let tenant = tpubox_core::Tenant::new("exec-spmd", tpubox_core::TenantLimits::default());
    let s = tpubox_core::Session::new(four(), Arc::default(), Arc::clone(&tenant));
    let infos = tpubox_core::exec::exec(&s, &prog, &args, &out)
        .await
        .unwrap();
    assert_eq!(infos.len(), 2);
    for i in &infos {
        assert_eq!(i.devices, vec![0, 1, 2, 3]);
    }
    assert_eq!(infos[0].dims, vec![8, 3]);
    assert_eq!(infos[0].sharding.as_deref(), Some("{devices=[4,1]<=[4]}"));
    assert_eq!(infos[1].dims, Vec::<i64>::new());
    assert_eq!(infos[1].sharding.as_deref(), Some("{replicated}"));
    let listed: Vec<OutputInfo> =
        serde_json::from_str(&std::fs::read_to_string(out.join("outputs.json")).unwrap()).unwrap();
    assert_eq!(listed, infos);
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let (descr, shape, data) = parse_npy(&std::fs::read(out.join("out0.npy")).unwrap());
    assert_eq!((descr.as_str(), shape.as_slice()), ("<f4", &[8, 3][..]));
    assert_eq!(f32s(&data), sum);
    let (_, shape, data) = parse_npy(&std::fs::read(out.join("out1.npy")).unwrap());
    assert!(shape.is_empty());
    assert_eq!(f32s(&data), vec![a.iter().sum::<f32>()]);
    drop(s);
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spmd_collective_runs_in_the_devices_given() {
    let dir = tempfile::tempdir().unwrap();
    let x = iota_f32(24, 1.0);
    let (prog, args) = spmd_files(dir.path(), "psum.mlir", PSUM4, &[(&[8, 3], &x)]);
    let out = dir.path().join("out");
    let s = tpubox_core::Session::new(
        four(),
        Arc::default(),
        tpubox_core::Tenant::new("exec-psum", tpubox_core::TenantLimits::default()),
    );
    let opts = tpubox_core::exec::ExecOptions {
        devices: Some(vec![3, 2, 1, 0]),
    };
    let infos = tpubox_core::exec::exec_with(&s, &prog, &args, &out, &opts)
        .await
        .unwrap();
    assert_eq!(infos[0].devices, vec![3, 2, 1, 0]);
    assert_eq!(infos[0].dims, vec![2, 3]);
    let want: Vec<f32> = (0..6)
        .map(|j| (0..4).map(|blk| x[blk * 6 + j]).sum())
        .collect();
    let (_, _, data) = parse_npy(&std::fs::read(out.join("out0.npy")).unwrap());
    assert_eq!(f32s(&data), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spmd_device_counts_that_do_not_fit_are_refused_with_both_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let x = iota_f32(24, 0.0);
    let (prog, args) = spmd_files(
        dir.path(),
        "gspmd.mlir",
        GSPMD4,
        &[(&[8, 3], &x), (&[8, 3], &x)],
    );
    let out = dir.path().join("out");
    let tenant =
        tpubox_core::Tenant::new("exec-spmd-hostile", tpubox_core::TenantLimits::default());
    let session = |devices: Vec<u32>| {
        tpubox_core::Session::new(four(), Arc::default(), Arc::clone(&tenant))
            .with_placement(tpubox_core::placement::Placement::fixed(devices))
    };
    // A session of 2 devices: the module needs 4.
    let e = tpubox_core::exec::exec(&session(vec![0, 1]), &prog, &args, &out)
        .await
        .unwrap_err();
    let d = device_error(&e);
    assert_eq!(d.kind, tpubox_core::ErrorKind::InvalidArgument, "{e:#}");
    assert!(
        d.message
            .contains("a program for 4 devices (mhlo.num_partitions = 4)")
            && d.message.contains("only 2 device(s) are available ([0, 1]"),
        "{e:#}"
    );
    // --devices listing another number.
    let opts = tpubox_core::exec::ExecOptions {
        devices: Some(vec![0, 1, 2]),
    };
    let e = tpubox_core::exec::exec_with(&session(vec![0, 1, 2, 3]), &prog, &args, &out, &opts)
        .await
        .unwrap_err();
    let d = device_error(&e);
    assert_eq!(d.kind, tpubox_core::ErrorKind::InvalidArgument, "{e:#}");
    assert!(d.message.contains("--devices lists 3 ([0, 1, 2])"), "{e:#}");
    // A device the session may not use.
    let opts = tpubox_core::exec::ExecOptions {
        devices: Some(vec![0, 1, 2, 3]),
    };
    let e = tpubox_core::exec::exec_with(&session(vec![0, 1, 2]), &prog, &args, &out, &opts)
        .await
        .unwrap_err();
    assert_eq!(
        device_error(&e).kind,
        tpubox_core::ErrorKind::PermissionDenied,
        "{e:#}"
    );
    // Replicas: refused, JAX exports partitions.
    let replicas = dir.path().join("replicas.mlir");
    std::fs::write(
        &replicas,
        GSPMD4.replace("mhlo.num_replicas = 1", "mhlo.num_replicas = 2"),
    )
    .unwrap();
    let e = tpubox_core::exec::exec(&session(vec![0, 1, 2, 3]), &replicas, &args, &out)
        .await
        .unwrap_err();
    assert_eq!(
        device_error(&e).kind,
        tpubox_core::ErrorKind::Unsupported,
        "{e:#}"
    );
    // The global array is expected, not a shard.
    let shard_dir = dir.path().join("shard");
    std::fs::create_dir(&shard_dir).unwrap();
    let shard = write_inputs(
        &shard_dir,
        &[input(PrimitiveType::F32, &[2, 3], le(&x[..6]))],
    );
    let e = tpubox_core::exec::exec(
        &session(vec![0, 1, 2, 3]),
        &prog,
        &[shard[0].clone(), args[1].clone()],
        &out,
    )
    .await
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("is f32[2,3] but")
            && format!("{e:#}").contains("expects f32[8,3] (the global array"),
        "{e:#}"
    );
    assert!(!out.join("outputs.json").exists());
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0)
    );
}

#[test]
fn cli_spmd_program_needs_its_devices() {
    let dir = tempfile::tempdir().unwrap();
    let x = iota_f32(24, 0.0);
    let (prog, args) = spmd_files(dir.path(), "psum.mlir", PSUM4, &[(&[8, 3], &x)]);
    let out = dir.path().join("o");
    let argv = |cpu_devices: &'static str| -> Vec<&std::ffi::OsStr> {
        vec![
            "exec".as_ref(),
            "--cpu-devices".as_ref(),
            cpu_devices.as_ref(),
            "--cache-mode".as_ref(),
            "off".as_ref(),
            prog.as_os_str(),
            "--arg".as_ref(),
            args[0].as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ]
    };
    // Exported for 4 devices, where the CPU plugin exposes 2: refused before compiling.
    let stderr = assert_cli_fails(&argv("2"), "tpubox: invalid-argument: ");
    assert!(
        stderr.contains(
            "psum.mlir is a program for 4 devices (mhlo.num_partitions = 4), and only 2 device(s) are available"
        ),
        "{stderr}"
    );
    assert!(!out.join("outputs.json").exists());
    let o = tpubox_cmd().args(argv("4")).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        stdout.trim(),
        "out0.npy: F32[2, 3] on devices [0, 1, 2, 3], {replicated}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("outputs.json")).unwrap()).unwrap();
    assert_eq!(json[0]["devices"], serde_json::json!([0, 1, 2, 3]));
}

#[tokio::test]
async fn one_device_programs_report_their_device() {
    let ran = run(
        "transpose_reshape.mlir",
        &[input(
            PrimitiveType::S32,
            &[2, 3],
            le(&[1i32, 2, 3, 4, 5, 6]),
        )],
    )
    .await;
    for i in &ran.infos {
        assert_eq!(i.devices, vec![0]);
        assert_eq!(i.sharding, None);
    }
    let json = std::fs::read_to_string(ran.out.join("outputs.json")).unwrap();
    assert!(!json.contains("sharding"), "{json}");
}
