//! A test guest for tpubox. `argv[1]` picks what it does; every case prints one line
//! `NAME: RESULT` that the host-side tests in `tests/all/guests.rs` assert on.
//!
//! - `env`: prints how many environment variables the guest sees and their names.
//! - `read PATH`: tries to read a file, printing `ok LEN` or `err`.
//! - `loop`: spins forever (the host's deadline must stop it).
//! - `alloc MIB`: allocates and touches that many MiB.
//! - `errors`: makes bad calls straight through the raw bindings (bypassing the SDK's own
//!   checks) and prints the error kind the host returned for each.
//! - `donate`: donates a tensor and checks it can no longer be used.
//! - `weights`: opens the host's weight set `test` (tensor `w`: `f32[2,2]`) and checks names,
//!   specs, reads, use in an execution and that donating a weight is refused.
//! - `publish`: publishes a tensor as weight set `pub` twice (WIT `weights.publish`), holds
//!   version 1 while 2 is the latest, reads both, and checks a published tensor cannot be
//!   donated; stops after the first line when the host refuses to publish.
//! - `noop`: returns at once (for timing instantiation).
//! - `exec-loop N`: executes a scalar add N times with inputs kept on the device and prints the
//!   guest-measured time (for the per-call benchmark).
//! - `check NAME`: makes only the bad call `NAME` of `errors`.
//! - `launch NAME [ARG]`: launches without waiting; see `launch.rs`. Used by
//!   `tests/all/launch.rs` and the bench `launch`.
//! - `sharded NAME`: programs over several devices and sharded arrays; see `sharded.rs`. Used
//!   by `tests/all/spmd.rs`.
//! - `abuse NAME [ARG]`: one misbehaviour (bombs, traps, forged handles, sandbox escapes); see
//!   `abuse.rs`. Used by `tests/all/adversarial.rs`.

mod abuse;
mod launch;
mod sharded;

use tpubox_guest::bindings::tpubox::device::{client, types};
use tpubox_guest::{Dtype, Tensor, compile_mlir};

const ADD: &str = r#"
func.func public @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  return %0 : tensor<2x2xf32>
}
"#;

fn report<T>(name: &str, r: Result<T, types::Error>) {
    match r {
        Ok(_) => println!("{name}: ok"),
        Err(e) => println!("{name}: {} ({})", e.kind.name(), e.message),
    }
}

fn raw_tensor(
    dtype: Dtype,
    dims: &[u64],
    len: usize,
    device: Option<u32>,
) -> Result<types::Tensor, types::Error> {
    types::Tensor::from_bytes(dtype, dims, &vec![0u8; len], device)
}

/// The bad calls of `errors`, each on fresh tensors, so that `check NAME` can make exactly one.
fn error_checks() -> Vec<(&'static str, Check)> {
    fn ok() -> types::Tensor {
        raw_tensor(Dtype::F32, &[2, 2], 16, None).expect("valid tensor")
    }
    fn add() -> types::Executable {
        client::compile(client::ProgramFormat::MlirText, ADD.as_bytes(), OPTS)
            .expect("ADD compiles")
    }
    const FMT: client::ProgramFormat = client::ProgramFormat::MlirText;
    const OPTS: client::CompileOptions = client::CompileOptions { device: None };
    vec![
        (
            "short-data",
            Box::new(|| unit(raw_tensor(Dtype::F32, &[2, 2], 15, None))),
        ),
        (
            "long-data",
            Box::new(|| unit(raw_tensor(Dtype::F32, &[2, 2], 17, None))),
        ),
        (
            "dims-overflow",
            Box::new(|| unit(raw_tensor(Dtype::F64, &[u64::MAX / 2, 4], 0, None))),
        ),
        (
            "dim-over-i64",
            Box::new(|| unit(raw_tensor(Dtype::U8, &[u64::MAX], 0, None))),
        ),
        (
            "rank-too-big",
            Box::new(|| unit(raw_tensor(Dtype::U8, &[1; 40], 1, None))),
        ),
        (
            "bad-device",
            Box::new(|| unit(raw_tensor(Dtype::F32, &[2, 2], 16, Some(999)))),
        ),
        (
            "empty-program",
            Box::new(|| unit(client::compile(FMT, &[], OPTS))),
        ),
        (
            "not-utf8",
            Box::new(|| unit(client::compile(FMT, &[0xff, 0xfe, 0x00], OPTS))),
        ),
        (
            "garbage-mlir",
            Box::new(|| unit(client::compile(FMT, b"this is not mlir", OPTS))),
        ),
        (
            "bad-bytecode",
            Box::new(|| {
                unit(client::compile(
                    client::ProgramFormat::MlirBytecode,
                    b"not bytecode",
                    OPTS,
                ))
            }),
        ),
        (
            "compile-bad-device",
            Box::new(|| {
                unit(client::compile(
                    FMT,
                    ADD.as_bytes(),
                    client::CompileOptions { device: Some(999) },
                ))
            }),
        ),
        (
            "arg-count",
            Box::new(|| unit(client::execute(&add(), &[&ok()], &[]))),
        ),
        (
            "arg-dtype",
            Box::new(|| {
                let wrong = raw_tensor(Dtype::S32, &[2, 2], 16, None).unwrap();
                unit(client::execute(&add(), &[&ok(), &wrong], &[]))
            }),
        ),
        (
            "arg-dims",
            Box::new(|| {
                let wrong = raw_tensor(Dtype::F32, &[4], 16, None).unwrap();
                unit(client::execute(&add(), &[&ok(), &wrong], &[]))
            }),
        ),
        (
            "donate-out-of-range",
            Box::new(|| unit(client::execute(&add(), &[&ok(), &ok()], &[2]))),
        ),
        (
            "donate-repeated",
            Box::new(|| unit(client::execute(&add(), &[&ok(), &ok()], &[0, 0]))),
        ),
        (
            "same-tensor-donated",
            Box::new(|| {
                let a = ok();
                unit(client::execute(&add(), &[&a, &a], &[0]))
            }),
        ),
        (
            "same-tensor-borrowed",
            Box::new(|| {
                let a = ok();
                unit(client::execute(&add(), &[&a, &a], &[]))
            }),
        ),
        (
            "valid-call",
            Box::new(|| unit(client::execute(&add(), &[&ok(), &ok()], &[]))),
        ),
    ]
}

type Check = Box<dyn Fn() -> Result<(), types::Error>>;

fn unit<T>(r: Result<T, types::Error>) -> Result<(), types::Error> {
    r.map(|_| ())
}

fn errors() {
    for (name, check) in error_checks() {
        report(name, check());
    }
}

/// `check NAME`: makes only the bad call `NAME` of `errors`.
fn check(name: &str) {
    match error_checks().into_iter().find(|(n, _)| *n == name) {
        Some((n, check)) => report(n, check()),
        None => {
            eprintln!("probe: no check named {name:?}");
            std::process::exit(2);
        }
    }
}

fn donate() {
    let exe = compile_mlir(ADD).expect("ADD compiles");
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = Tensor::from_slice(&[10.0f32, 20.0, 30.0, 40.0], &[2, 2]).unwrap();
    let out =
        client::execute(exe.as_raw(), &[a.as_raw(), b.as_raw()], &[0]).expect("donating call");
    let sum = Tensor::from_raw(out.into_iter().next().unwrap());
    println!("donate-result: {:?}", sum.to_vec::<f32>().unwrap());
    report("read-after-donate", a.as_raw().read());
    report(
        "execute-after-donate",
        client::execute(exe.as_raw(), &[a.as_raw(), b.as_raw()], &[]),
    );
    report("copy-after-donate", a.as_raw().copy_to_device(0));
    println!("spec-after-donate: {:?}", a.as_raw().spec().dims);
    report("b-still-usable", b.as_raw().read());
}

const SCALAR_ADD: &str = r#"
func.func public @main(%a: tensor<f32>, %b: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %b : tensor<f32>
  return %0 : tensor<f32>
}
"#;

fn exec_loop(n: u32) {
    let exe = compile_mlir(SCALAR_ADD).expect("scalar add compiles");
    let a = Tensor::scalar(1.5f32).unwrap();
    let b = Tensor::scalar(2.25f32).unwrap();
    let mut last = exe.call(&[&a, &b]).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..n {
        last = exe.call(&[&a, &b]).unwrap();
    }
    let ns = start.elapsed().as_nanos();
    let value: f32 = last[0].to_scalar().unwrap();
    println!("exec-loop: {n} {ns} {value}");
}

fn weights() {
    use tpubox_guest::weights::{WeightSet, available};
    println!("available: {}", available().join(","));
    report(
        "missing-set",
        WeightSet::open("nope").map_err(types::Error::from),
    );
    let set = WeightSet::open("test").expect("the test host offers `test`");
    println!("names: {}", set.names().join(","));
    let spec = set.spec("w").expect("w exists");
    println!("spec-w: {:?} {:?}", spec.dtype, spec.dims);
    report(
        "missing-tensor",
        set.get("nope").map_err(types::Error::from),
    );
    let w = set.get("w").expect("w exists");
    println!("read-w: {:?}", w.to_vec::<f32>().unwrap());
    let exe = compile_mlir(ADD).expect("ADD compiles");
    let sum = exe.call(&[&w, &w]).expect("weights can be arguments");
    println!("w-plus-w: {:?}", sum[0].to_vec::<f32>().unwrap());
    let other = Tensor::from_slice(&[1.0f32; 4], &[2, 2]).unwrap();
    report(
        "donate-weight",
        client::execute(exe.as_raw(), &[w.as_raw(), other.as_raw()], &[0]),
    );
    println!(
        "read-w-again: {:?}",
        set.get("w").unwrap().to_vec::<f32>().unwrap()
    );
}

fn publish() {
    use tpubox_guest::weights::{self, WeightSet};
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    match weights::publish("pub", &[("w", &a)], &["*"]) {
        Ok(v) => println!("publish-1: {v}"),
        Err(e) => {
            println!("publish-1: {} ({})", e.kind().name(), e.message());
            return;
        }
    }
    let v1 = WeightSet::open("pub").expect("the guest reads its own set");
    println!("opened: {}", v1.version());
    let b = Tensor::from_slice(&[10.0f32, 20.0, 30.0, 40.0], &[2, 2]).unwrap();
    println!(
        "publish-2: {}",
        weights::publish("pub", &[("w", &b)], &["*"]).unwrap()
    );
    let (latest, held) = weights::versions("pub").unwrap();
    println!("versions: {latest} {held:?}");
    let old = WeightSet::open_version("pub", 1).unwrap();
    println!(
        "read-v1: {:?}",
        old.get("w").unwrap().to_vec::<f32>().unwrap()
    );
    let new = WeightSet::open("pub").unwrap();
    println!(
        "read-latest: {} {:?}",
        new.version(),
        new.get("w").unwrap().to_vec::<f32>().unwrap()
    );
    drop((v1, old));
    let (latest, held) = weights::versions("pub").unwrap();
    println!("versions-after-drop: {latest} {held:?}");
    report(
        "open-freed",
        WeightSet::open_version("pub", 1).map_err(types::Error::from),
    );
    let exe = compile_mlir(ADD).expect("ADD compiles");
    report(
        "donate-published",
        client::execute(exe.as_raw(), &[a.as_raw(), b.as_raw()], &[0]),
    );
    let sum = exe
        .call(&[&a, &b])
        .expect("published tensors can be arguments");
    println!("a-plus-b: {:?}", sum[0].to_vec::<f32>().unwrap());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("env") => {
            let names: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
            println!("env: {} {}", names.len(), names.join(","));
        }
        Some("read") => match std::fs::read(&args[2]) {
            Ok(b) => println!("read: ok {}", b.len()),
            Err(_) => println!("read: err"),
        },
        Some("loop") => {
            let mut x: u64 = 0;
            loop {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        Some("alloc") => {
            let mib: usize = args[2].parse().unwrap();
            let mut v = vec![0u8; mib << 20];
            v[(mib << 20) - 1] = 1;
            println!("alloc: ok {}", v.iter().map(|&b| b as usize).sum::<usize>());
        }
        Some("errors") => errors(),
        Some("noop") => {}
        Some("weights") => weights(),
        Some("publish") => publish(),
        Some("exec-loop") => match args.get(2).and_then(|n| n.parse().ok()) {
            Some(n) => exec_loop(n),
            None => {
                eprintln!("usage: probe exec-loop N");
                std::process::exit(2);
            }
        },
        Some("donate") => donate(),
        Some("check") if args.len() == 3 => check(&args[2]),
        Some("abuse") if args.len() >= 3 => abuse::run(&args[2], args.get(3).map(String::as_str)),
        Some("launch") if args.len() >= 3 => launch::run(&args[2], args.get(3).map(String::as_str)),
        Some("sharded") if args.len() == 3 => sharded::run(&args[2]),
        _ => {
            eprintln!(
                "usage: probe env|read PATH|loop|alloc MIB|errors|check NAME|abuse NAME [ARG]|launch NAME [ARG]|sharded NAME|donate|weights|publish|noop|exec-loop N"
            );
            std::process::exit(2);
        }
    }
}
