//! The `wit_calls` harness: random sequences of `tpubox:device` calls against one long-lived host.
//!
//! Shared by the cargo-fuzz target (`fuzz/fuzz_targets/wit_calls.rs`) and the ordinary test that
//! replays `fuzz/regressions/wit_calls/` (`tests/all/fuzz_regressions.rs`), through `#[path]`.
//!
//! Each input decodes (with `arbitrary`) into tenant limits and a list of operations: create
//! tensors with random dtype, dims, bytes and device; copy, read, inspect and drop them; compile
//! one of a few valid StableHLO programs, a mutated one, or random bytes (text or bytecode) for a
//! random device; execute with random handles (live, dropped, donated, forged or of the wrong
//! resource type) and random donate lists; open weight sets, get and donate weights; drop
//! executables. The calls go through the generated WIT host traits on a [`DeviceState`] (the
//! one the sandbox uses), with a fresh resource table, session and [`Tenant`] per input; the device service and weight
//! registry are built once per process.
//!
//! Invariants checked:
//! - nothing panics or aborts;
//! - a `wasmtime::Result` error (a trap: forged or stale handle) is allowed, but every typed
//!   `error` carries a kind from the set `wit/device.wit` documents for that call (plus
//!   `resource-exhausted` for calls that charge the tenant);
//! - successful calls return what they promise (specs, byte sizes, bytes read back, output
//!   count and specs);
//! - the tenant never holds more than its limits, and holds nothing once the table is dropped.
//!
//! Run: `bash scripts/dev.sh fuzz [SECONDS]`.

use std::sync::{Arc, OnceLock};

use arbitrary::Arbitrary;
use tpubox_core::DeviceConfig;
use tpubox_core::cache::CacheConfig;
use tpubox_core::device::DeviceService;
use tpubox_core::session::TensorHandle;
use tpubox_core::weights::WeightRegistry;
use tpubox_core::{DeviceError, ErrorKind, NamedValue, Session, Tenant, TenantLimits};
use tpubox_wasm::wit::generated::tpubox::device::client::{self, CompileOptions, ProgramFormat};
use tpubox_wasm::wit::generated::tpubox::device::types::{self, Dtype};
use tpubox_wasm::wit::generated::tpubox::device::weights;
use tpubox_wasm::wit::{DeviceState, GuestWeightSet, HostError};
use wasmtime::component::{Resource, ResourceTable};

/// Valid programs the fuzzer compiles (and mutates). Their parameters use the shapes the
/// weight set offers, so weights can be passed (and donation of them refused).
const PROGRAMS: &[&str] = &[
    // 0: tanh(x·w + b), as hello-matmul.
    r#"module @m0 {
  func.func public @main(%x: tensor<2x3xf32>, %w: tensor<3x4xf32>, %b: tensor<4xf32>) -> tensor<2x4xf32> {
    %xw = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %bb = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>
    %s = stablehlo.add %xw, %bb : tensor<2x4xf32>
    %o = stablehlo.tanh %s : tensor<2x4xf32>
    func.return %o : tensor<2x4xf32>
  }
}"#,
    // 1: a + b with the first parameter aliased to the output (donation reuses it).
    r#"module @m1 {
  func.func public @main(%a: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %b: tensor<4xf32>) -> tensor<4xf32> {
    %s = stablehlo.add %a, %b : tensor<4xf32>
    func.return %s : tensor<4xf32>
  }
}"#,
    // 2: four results of different dtypes and ranks, one of them zero-sized.
    r#"module @m2 {
  func.func public @main(%a: tensor<2x3xf32>) -> (tensor<f32>, tensor<0x3xf32>, tensor<3x2xi64>, tensor<2x3xf64>) {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %sum = stablehlo.reduce(%a init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x3xf32>, tensor<f32>) -> tensor<f32>
    %empty = stablehlo.slice %a [0:0, 0:3] : (tensor<2x3xf32>) -> tensor<0x3xf32>
    %iota = stablehlo.iota dim = 0 : tensor<3x2xi64>
    %wide = stablehlo.convert %a : (tensor<2x3xf32>) -> tensor<2x3xf64>
    %sq = stablehlo.multiply %wide, %wide : tensor<2x3xf64>
    return %sum, %empty, %iota, %sq : tensor<f32>, tensor<0x3xf32>, tensor<3x2xi64>, tensor<2x3xf64>
  }
}"#,
    // 3: no parameters.
    r#"module @m3 {
  func.func public @main() -> tensor<2xi32> {
    %c = stablehlo.constant dense<[7, -7]> : tensor<2xi32>
    func.return %c : tensor<2xi32>
  }
}"#,
    // 4: scalars and small dtypes: s32 add, bf16 → f32, pred select.
    r#"module @m4 {
  func.func public @main(%a: tensor<i32>, %b: tensor<i32>, %h: tensor<3xbf16>, %p: tensor<3xi1>) -> (tensor<i32>, tensor<3xf32>) {
    %s = stablehlo.add %a, %b : tensor<i32>
    %f = stablehlo.convert %h : (tensor<3xbf16>) -> tensor<3xf32>
    %z = stablehlo.constant dense<0.0> : tensor<3xf32>
    %r = stablehlo.select %p, %f, %z : tensor<3xi1>, tensor<3xf32>
    func.return %s, %r : tensor<i32>, tensor<3xf32>
  }
}"#,
    // 5: identity and a duplicate result (outputs that are the input buffer).
    r#"module @m5 {
  func.func public @main(%a: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    func.return %a, %a : tensor<4xf32>, tensor<4xf32>
  }
}"#,
    // 6: a large result from nothing: 64 Mi f32 (the tenant's byte limit must refuse it).
    r#"module @m6 {
  func.func public @main() -> tensor<67108864xf32> {
    %i = stablehlo.iota dim = 0 : tensor<67108864xf32>
    func.return %i : tensor<67108864xf32>
  }
}"#,
];

/// Magic bytes of MLIR bytecode.
const BYTECODE_MAGIC: &[u8] = b"ML\xefR";

/// Names of the weight sets: one loaded, one not.
const WEIGHT_SETS: &[&str] = &["tiny", "missing", ""];
/// Tensor names asked of a weight set: the ones it has, and one it lacks.
const WEIGHT_NAMES: &[&str] = &["b", "w", "s", "e", "nope"];

/// Everything built once per process.
struct Shared {
    rt: tokio::runtime::Runtime,
    device: Arc<DeviceService>,
    weights: Arc<WeightRegistry>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        // Two CPU devices so copies and cross-device arguments are exercised; an in-memory
        // compile cache so repeated valid programs cost little.
        let config = DeviceConfig {
            client_options: vec![("cpu_device_count".into(), NamedValue::Int64(2))],
            cache: CacheConfig {
                disk_dir: None,
                remote_url: None,
                ..CacheConfig::default()
            },
            ..DeviceConfig::default()
        };
        let device = tpubox_core::open_device(&config).expect("open the PJRT CPU device");
        let weights = Arc::new(WeightRegistry::new());
        let path = std::env::temp_dir().join(format!(
            "tpubox-fuzz-weights-{}.safetensors",
            std::process::id()
        ));
        std::fs::write(&path, tiny_safetensors()).expect("write the weight file");
        weights
            .load_safetensors(&device, "tiny", &path, 0)
            .expect("load the tiny weight set");
        let _ = std::fs::remove_file(&path);
        Shared {
            rt,
            device,
            weights,
        }
    })
}

/// A safetensors file with `w: f32[3,4]`, `b: f32[4]`, `s: i32[]` and `e: f32[0]`.
fn tiny_safetensors() -> Vec<u8> {
    let tensors: [(&str, &str, &[usize], Vec<u8>); 4] = [
        (
            "w",
            "F32",
            &[3, 4],
            (0..12)
                .flat_map(|i| (i as f32 * 0.1).to_le_bytes())
                .collect(),
        ),
        (
            "b",
            "F32",
            &[4],
            (0..4)
                .flat_map(|i| (i as f32 - 1.5).to_le_bytes())
                .collect(),
        ),
        ("s", "I32", &[], 42i32.to_le_bytes().to_vec()),
        ("e", "F32", &[0], Vec::new()),
    ];
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, (name, dtype, shape, bytes)) in tensors.iter().enumerate() {
        let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            shape.join(","),
            data.len(),
            data.len() + bytes.len()
        ));
        data.extend_from_slice(bytes);
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    file
}

/// Tenant limits, kept small so refusals are common.
#[derive(Arbitrary, Debug)]
struct Limits {
    device_bytes: u16,
    live_tensors: u8,
    live_executables: u8,
    program_bytes: u16,
    compiles: u8,
}

/// How a handle argument is chosen.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Handle {
    /// The i-th (mod count) tensor handle ever made in this input, live or not.
    Tensor(u8),
    /// The i-th executable handle ever made (the wrong type where a tensor is wanted).
    Exe(u8),
    /// The i-th weight-set handle ever opened.
    Set(u8),
    /// A representation nobody handed out.
    Forged(u32),
}

/// One dimension.
#[derive(Arbitrary, Debug)]
enum Dim {
    Small(u8),
    Any(u64),
}

/// The bytes of a new tensor.
#[derive(Arbitrary, Debug)]
enum Data {
    /// Exactly the right length (when small), filled from a seed.
    Exact(u8),
    /// Whatever the input says (usually the wrong length).
    Raw(Vec<u8>),
}

/// A program to compile.
#[derive(Arbitrary, Debug)]
enum Program {
    Valid(u8),
    /// A valid program with `bytes` written over it at `pos`.
    Mutated {
        which: u8,
        pos: u16,
        bytes: Vec<u8>,
    },
    /// A valid program truncated at `len`.
    Truncated {
        which: u8,
        len: u16,
    },
    /// Random bytes, compiled as text or as bytecode.
    Raw {
        text: bool,
        bytes: Vec<u8>,
    },
    /// The bytecode magic followed by random bytes.
    Bytecode(Vec<u8>),
    /// Valid text sent as bytecode.
    WrongFormat(u8),
}

#[derive(Arbitrary, Debug)]
enum Op {
    FromBytes {
        dtype: u8,
        dims: Vec<Dim>,
        data: Data,
        device: Option<u8>,
    },
    Spec(Handle),
    Device(Handle),
    ByteSize(Handle),
    Read(Handle),
    CopyToDevice(Handle, u8),
    DropTensor(Handle),
    Compile {
        program: Program,
        device: Option<u8>,
    },
    ExeInfo(Handle),
    DropExe(Handle),
    /// Execute with arbitrary handles.
    Execute {
        exe: Handle,
        args: Vec<Handle>,
        donate: Vec<u8>,
    },
    /// Execute with arguments picked (or made) to match the executable's parameters, so
    /// execution itself is reached; `forge` replaces one of them.
    ExecuteMatching {
        exe: Handle,
        picks: Vec<u8>,
        donate: Vec<u8>,
        forge: Option<(u8, Handle)>,
    },
    Platform,
    ListDevices,
    Available,
    Open(u8),
    SetNames(Handle),
    SetSpec(Handle, u8),
    SetGet(Handle, u8),
    DropSet(Handle),
}

/// One fuzz input: the tenant's limits and the calls to make.
#[derive(Arbitrary, Debug)]
pub struct Input {
    limits: Limits,
    ops: Vec<Op>,
}

const DTYPES: [Dtype; 15] = [
    Dtype::Pred,
    Dtype::S8,
    Dtype::S16,
    Dtype::S32,
    Dtype::S64,
    Dtype::U8,
    Dtype::U16,
    Dtype::U32,
    Dtype::U64,
    Dtype::F16,
    Dtype::Bf16,
    Dtype::F32,
    Dtype::F64,
    Dtype::C64,
    Dtype::C128,
];

fn dtype_size(d: Dtype) -> u64 {
    match d {
        Dtype::Pred | Dtype::S8 | Dtype::U8 => 1,
        Dtype::S16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
        Dtype::S32 | Dtype::U32 | Dtype::F32 => 4,
        Dtype::S64 | Dtype::U64 | Dtype::F64 | Dtype::C64 => 8,
        Dtype::C128 => 16,
    }
}

/// What the fuzzer remembers about a tensor handle it was given.
struct Known {
    rep: u32,
    spec: types::TensorSpec,
    /// Bytes it was created from (or copied from), when known and worth checking.
    bytes: Option<Vec<u8>>,
}

/// Per-input state: the handles handed out, in order (dropped ones stay, to be reused).
struct Run {
    state: DeviceState,
    tensors: Vec<Known>,
    exes: Vec<u32>,
    sets: Vec<u32>,
}

fn pick<T: Copy>(list: &[T], i: u8) -> Option<T> {
    (!list.is_empty()).then(|| list[i as usize % list.len()])
}

fn same_spec(a: &types::TensorSpec, b: &types::TensorSpec) -> bool {
    a.dtype == b.dtype && a.dims == b.dims
}

/// Panics unless `kind` is one of `allowed` for `call`.
fn check_kind(call: &str, e: &DeviceError, allowed: &[ErrorKind]) {
    assert!(
        allowed.contains(&e.kind),
        "{call} returned an undocumented error kind {:?}: {}",
        e.kind,
        e.message
    );
}

impl Run {
    fn ctx(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    fn rep(&self, h: Handle) -> u32 {
        let tensors: Vec<u32> = self.tensors.iter().map(|k| k.rep).collect();
        match h {
            Handle::Tensor(i) => pick(&tensors, i),
            Handle::Exe(i) => pick(&self.exes, i),
            Handle::Set(i) => pick(&self.sets, i),
            Handle::Forged(r) => Some(r),
        }
        .unwrap_or(u32::MAX)
    }

    fn tensor(&self, h: Handle) -> Resource<TensorHandle> {
        Resource::new_borrow(self.rep(h))
    }

    fn known(&self, rep: u32) -> Option<&Known> {
        self.tensors.iter().rev().find(|k| k.rep == rep)
    }

    /// Records a new tensor handle, checking its spec when one is expected.
    async fn remember(
        &mut self,
        r: Resource<TensorHandle>,
        expect: Option<&types::TensorSpec>,
        bytes: Option<Vec<u8>>,
    ) {
        let rep = r.rep();
        let spec = types::HostTensor::spec(&mut self.ctx(), Resource::new_borrow(rep))
            .await
            .expect("a tensor just handed out has a spec");
        if let Some(e) = expect {
            assert!(
                same_spec(&spec, e),
                "a new tensor's spec {spec:?} differs from the promised {e:?}"
            );
        }
        let size = types::HostTensor::byte_size(&mut self.ctx(), Resource::new_borrow(rep))
            .await
            .expect("byte-size of a live handle");
        let want = spec
            .dims
            .iter()
            .try_fold(dtype_size(spec.dtype), |a, &d| a.checked_mul(d));
        assert_eq!(Some(size), want, "byte-size disagrees with dtype × dims");
        self.tensors.push(Known { rep, spec, bytes });
    }

    async fn op(&mut self, op: Op) {
        match op {
            Op::FromBytes {
                dtype,
                dims,
                data,
                device,
            } => {
                let dtype = DTYPES[dtype as usize % DTYPES.len()];
                let dims: Vec<u64> = dims
                    .iter()
                    .take(20)
                    .map(|d| match d {
                        Dim::Small(s) => u64::from(s % 6),
                        Dim::Any(a) => *a,
                    })
                    .collect();
                let want = dims
                    .iter()
                    .try_fold(dtype_size(dtype), |a, &d| a.checked_mul(d));
                let bytes = match data {
                    Data::Exact(seed) => match want {
                        Some(n) if n <= 1 << 16 => (0..n)
                            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                            .collect(),
                        _ => Vec::new(),
                    },
                    Data::Raw(b) => b,
                };
                let res = types::HostTensor::from_bytes(
                    &mut self.ctx(),
                    dtype,
                    dims.clone(),
                    bytes.clone(),
                    device.map(u32::from),
                )
                .await;
                match res {
                    Err(HostError::Trap(t)) => panic!("from-bytes trapped: {t:#}"),
                    Ok(r) => {
                        assert_eq!(Some(bytes.len() as u64), want, "accepted a wrong length");
                        let spec = types::TensorSpec { dtype, dims };
                        let keep = (dtype != Dtype::Pred).then_some(bytes);
                        self.remember(r, Some(&spec), keep).await;
                    }
                    Err(HostError::Device(e)) => check_kind(
                        "tensor.from-bytes",
                        &e,
                        &[
                            ErrorKind::InvalidArgument,
                            ErrorKind::NotFound,
                            ErrorKind::ResourceExhausted,
                        ],
                    ),
                }
            }
            Op::Spec(h) => {
                let r = self.tensor(h);
                let _ = types::HostTensor::spec(&mut self.ctx(), r).await;
            }
            Op::Device(h) => {
                let r = self.tensor(h);
                let _ = types::HostTensor::device(&mut self.ctx(), r).await;
            }
            Op::ByteSize(h) => {
                let r = self.tensor(h);
                let _ = types::HostTensor::byte_size(&mut self.ctx(), r).await;
            }
            Op::Read(h) => {
                let rep = self.rep(h);
                let res = types::HostTensor::read(&mut self.ctx(), Resource::new_borrow(rep)).await;
                match res {
                    Err(HostError::Trap(_)) => {}
                    Ok(bytes) => {
                        if let Some(k) = self.known(rep) {
                            let size = k
                                .spec
                                .dims
                                .iter()
                                .product::<u64>()
                                .saturating_mul(dtype_size(k.spec.dtype));
                            assert_eq!(bytes.len() as u64, size, "read returned a wrong length");
                            if let Some(orig) = &k.bytes {
                                assert_eq!(&bytes, orig, "read returned other bytes than written");
                            }
                        }
                    }
                    Err(HostError::Device(e)) => {
                        check_kind("tensor.read", &e, &[ErrorKind::FailedPrecondition])
                    }
                }
            }
            Op::CopyToDevice(h, device) => {
                let rep = self.rep(h);
                let res = types::HostTensor::copy_to_device(
                    &mut self.ctx(),
                    Resource::new_borrow(rep),
                    u32::from(device % 4),
                )
                .await;
                match res {
                    Err(HostError::Trap(_)) => {}
                    Ok(r) => {
                        let (spec, bytes) = match self.known(rep) {
                            Some(k) => (Some(k.spec.clone()), k.bytes.clone()),
                            None => (None, None),
                        };
                        self.remember(r, spec.as_ref(), bytes).await;
                    }
                    // Undocumented in the WIT; these are the kinds `read` and `from-bytes` use.
                    Err(HostError::Device(e)) => check_kind(
                        "tensor.copy-to-device",
                        &e,
                        &[
                            ErrorKind::FailedPrecondition,
                            ErrorKind::NotFound,
                            ErrorKind::ResourceExhausted,
                        ],
                    ),
                }
            }
            Op::DropTensor(h) => {
                let r = Resource::new_own(self.rep(h));
                let _ = types::HostTensor::drop(&mut self.ctx(), r).await;
            }
            Op::Compile { program, device } => {
                let (text, code) = program_bytes(program);
                let format = if text {
                    ProgramFormat::MlirText
                } else {
                    ProgramFormat::MlirBytecode
                };
                let options = CompileOptions {
                    device: device.map(|d| u32::from(d % 4)),
                };
                let res = client::Host::compile(&mut self.ctx(), format, code, options).await;
                match res {
                    Ok(r) => self.exes.push(r.rep()),
                    Err(HostError::Trap(t)) => panic!("compile trapped: {t:#}"),
                    Err(HostError::Device(e)) => check_kind(
                        "client.compile",
                        &e,
                        &[
                            ErrorKind::InvalidArgument,
                            ErrorKind::NotFound,
                            ErrorKind::CompileFailed,
                            ErrorKind::ResourceExhausted,
                            // The program policy (loops, host transfers, custom calls).
                            ErrorKind::PermissionDenied,
                        ],
                    ),
                }
            }
            Op::ExeInfo(h) => {
                let rep = self.rep(h);
                let mut ctx = self.ctx();
                let _ = types::HostExecutable::inputs(&mut ctx, Resource::new_borrow(rep)).await;
                let _ = types::HostExecutable::outputs(&mut ctx, Resource::new_borrow(rep)).await;
                let _ = types::HostExecutable::device(&mut ctx, Resource::new_borrow(rep)).await;
                let _ =
                    types::HostExecutable::fingerprint(&mut ctx, Resource::new_borrow(rep)).await;
            }
            Op::DropExe(h) => {
                let r = Resource::new_own(self.rep(h));
                let _ = types::HostExecutable::drop(&mut self.ctx(), r).await;
            }
            Op::Execute { exe, args, donate } => {
                let exe = self.rep(exe);
                let args: Vec<u32> = args.iter().take(8).map(|&h| self.rep(h)).collect();
                let donate: Vec<u32> = donate.iter().take(8).map(|&d| u32::from(d % 9)).collect();
                self.execute(exe, args, donate).await;
            }
            Op::ExecuteMatching {
                exe,
                picks,
                donate,
                forge,
            } => {
                let exe = self.rep(exe);
                let Ok(inputs) =
                    types::HostExecutable::inputs(&mut self.ctx(), Resource::new_borrow(exe)).await
                else {
                    return;
                };
                let mut args = Vec::with_capacity(inputs.len());
                for (i, want) in inputs.iter().enumerate() {
                    let matching: Vec<u32> = self
                        .tensors
                        .iter()
                        .filter(|k| same_spec(&k.spec, want))
                        .map(|k| k.rep)
                        .collect();
                    let p = picks.get(i).copied().unwrap_or(0) as usize % (matching.len() + 1);
                    // The pick one past the matching ones makes a fresh tensor of the right spec.
                    let rep = match matching.get(p) {
                        Some(&r) => r,
                        None => match self.make(want).await {
                            Some(r) => r,
                            None => return,
                        },
                    };
                    args.push(rep);
                }
                if let Some((i, h)) = forge
                    && !args.is_empty()
                {
                    let n = args.len();
                    args[i as usize % n] = self.rep(h);
                }
                let n = args.len().max(1) as u32;
                let donate: Vec<u32> = donate.iter().take(4).map(|&d| u32::from(d) % n).collect();
                self.execute(exe, args, donate).await;
            }
            Op::Platform => {
                let p = client::Host::platform(&mut self.ctx())
                    .await
                    .expect("platform");
                assert!(!p.name.is_empty());
            }
            Op::ListDevices => {
                let d = client::Host::list_devices(&mut self.ctx())
                    .await
                    .expect("list-devices");
                assert!(d.iter().enumerate().all(|(i, d)| d.index as usize == i));
            }
            Op::Available => {
                let names = weights::Host::available(&mut self.ctx())
                    .await
                    .expect("available");
                assert_eq!(names, vec!["tiny".to_string()]);
            }
            Op::Open(i) => {
                let name = WEIGHT_SETS[i as usize % WEIGHT_SETS.len()].to_string();
                let res = weights::Host::open(&mut self.ctx(), name).await;
                match res {
                    Ok(r) => self.sets.push(r.rep()),
                    Err(HostError::Trap(t)) => panic!("open trapped: {t:#}"),
                    Err(HostError::Device(e)) => {
                        check_kind("weights.open", &e, &[ErrorKind::NotFound])
                    }
                }
            }
            Op::SetNames(h) => {
                let r = Resource::new_borrow(self.rep(h));
                let _ = weights::HostWeightSet::names(&mut self.ctx(), r).await;
            }
            Op::SetSpec(h, n) => {
                let r: Resource<GuestWeightSet> = Resource::new_borrow(self.rep(h));
                let name = WEIGHT_NAMES[n as usize % WEIGHT_NAMES.len()].to_string();
                if let Err(HostError::Device(e)) =
                    weights::HostWeightSet::spec(&mut self.ctx(), r, name).await
                {
                    check_kind("weight-set.spec", &e, &[ErrorKind::NotFound]);
                }
            }
            Op::SetGet(h, n) => {
                let r: Resource<GuestWeightSet> = Resource::new_borrow(self.rep(h));
                let name = WEIGHT_NAMES[n as usize % WEIGHT_NAMES.len()].to_string();
                let res = weights::HostWeightSet::get(&mut self.ctx(), r, name).await;
                match res {
                    Err(HostError::Trap(_)) => {}
                    Ok(t) => self.remember(t, None, None).await,
                    Err(HostError::Device(e)) => check_kind(
                        "weight-set.get",
                        &e,
                        &[ErrorKind::NotFound, ErrorKind::ResourceExhausted],
                    ),
                }
            }
            Op::DropSet(h) => {
                let r: Resource<GuestWeightSet> = Resource::new_own(self.rep(h));
                let _ = weights::HostWeightSet::drop(&mut self.ctx(), r).await;
            }
        }
    }

    /// Makes a tensor of `spec` on device 0 with deterministic bytes; `None` when refused.
    async fn make(&mut self, spec: &types::TensorSpec) -> Option<u32> {
        let n = spec
            .dims
            .iter()
            .try_fold(dtype_size(spec.dtype), |a, &d| a.checked_mul(d))?;
        if n > 1 << 16 {
            return None;
        }
        let bytes: Vec<u8> = (0..n)
            .map(|i| match spec.dtype {
                Dtype::Pred => (i % 2) as u8,
                _ => (i as u8).wrapping_mul(7),
            })
            .collect();
        let res = types::HostTensor::from_bytes(
            &mut self.ctx(),
            spec.dtype,
            spec.dims.clone(),
            bytes.clone(),
            None,
        )
        .await;
        match res {
            Err(HostError::Trap(t)) => panic!("from-bytes trapped: {t:#}"),
            Ok(r) => {
                let rep = r.rep();
                self.remember(r, Some(spec), Some(bytes)).await;
                Some(rep)
            }
            Err(HostError::Device(e)) => {
                check_kind("tensor.from-bytes", &e, &[ErrorKind::ResourceExhausted]);
                None
            }
        }
    }

    async fn execute(&mut self, exe: u32, args: Vec<u32>, donate: Vec<u32>) {
        let outputs =
            types::HostExecutable::outputs(&mut self.ctx(), Resource::new_borrow(exe)).await;
        let res = client::Host::execute(
            &mut self.ctx(),
            Resource::new_borrow(exe),
            args.iter().map(|&r| Resource::new_borrow(r)).collect(),
            donate,
        )
        .await;
        match res {
            Err(HostError::Trap(_)) => {}
            Ok(handles) => {
                let outputs = outputs.expect("a valid executable has outputs");
                assert_eq!(handles.len(), outputs.len(), "wrong number of results");
                for (h, spec) in handles.into_iter().zip(&outputs) {
                    self.remember(h, Some(spec), None).await;
                }
            }
            Err(HostError::Device(e)) => check_kind(
                "client.execute",
                &e,
                &[
                    ErrorKind::InvalidArgument,
                    ErrorKind::FailedPrecondition,
                    ErrorKind::PermissionDenied,
                    ErrorKind::ExecutionFailed,
                    ErrorKind::ResourceExhausted,
                ],
            ),
        }
    }
}

/// The program bytes and whether they are sent as text.
fn program_bytes(p: Program) -> (bool, Vec<u8>) {
    let valid = |i: u8| PROGRAMS[i as usize % PROGRAMS.len()].as_bytes().to_vec();
    match p {
        Program::Valid(i) => (true, valid(i)),
        Program::Mutated { which, pos, bytes } => {
            let mut code = valid(which);
            let start = (pos as usize).min(code.len());
            for (i, b) in bytes.into_iter().take(64).enumerate() {
                match code.get_mut(start + i) {
                    Some(c) => *c = b,
                    None => code.push(b),
                }
            }
            (true, code)
        }
        Program::Truncated { which, len } => {
            let mut code = valid(which);
            code.truncate(len as usize);
            (true, code)
        }
        Program::Raw { text, bytes } => (text, bytes),
        Program::Bytecode(rest) => {
            let mut code = BYTECODE_MAGIC.to_vec();
            code.extend(rest);
            (false, code)
        }
        Program::WrongFormat(i) => (false, valid(i)),
    }
}

/// Decodes `data` as libFuzzer's `fuzz_target!` does (`arbitrary_take_rest`) and runs it;
/// inputs that do not decode are skipped.
pub fn run_bytes(data: &[u8]) {
    if let Ok(input) = Input::arbitrary_take_rest(arbitrary::Unstructured::new(data)) {
        run(input);
    }
}

/// Runs one input against the shared host, asserting the invariants in the module docs.
pub fn run(input: Input) {
    let s = shared();
    let l = &input.limits;
    let limits = TenantLimits {
        max_device_bytes: u64::from(l.device_bytes),
        max_live_tensors: u64::from(l.live_tensors % 48),
        max_live_executables: u64::from(l.live_executables % 6),
        max_program_bytes: usize::from(l.program_bytes),
        max_compiles_per_minute: u32::from(l.compiles % 8),
        ..TenantLimits::default()
    };
    let tenant = Tenant::new("fuzz", limits.clone());
    let mut table = ResourceTable::new();
    table.set_max_capacity(4096);
    let session = Session::new(
        Arc::clone(&s.device),
        Arc::clone(&s.weights),
        Arc::clone(&tenant),
    );
    let mut run = Run {
        state: DeviceState::with_table(table, session),
        tensors: Vec::new(),
        exes: Vec::new(),
        sets: Vec::new(),
    };
    s.rt.block_on(async {
        for op in input.ops.into_iter().take(64) {
            run.op(op).await;
            let u = tenant.usage();
            assert!(u.device_bytes <= limits.max_device_bytes, "{u:?}");
            assert!(u.live_tensors <= limits.max_live_tensors, "{u:?}");
            assert!(u.live_executables <= limits.max_live_executables, "{u:?}");
        }
    });
    let u = tenant.usage();
    assert!(u.peak_device_bytes <= limits.max_device_bytes, "{u:?}");
    assert!(u.peak_live_tensors <= limits.max_live_tensors, "{u:?}");
    drop(run);
    let u = tenant.usage();
    assert_eq!(
        (u.device_bytes, u.live_tensors, u.live_executables),
        (0, 0, 0),
        "the tenant still holds something after its table was dropped: {u:?}"
    );
}
