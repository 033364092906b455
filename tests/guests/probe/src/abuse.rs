//! `abuse NAME [ARG]`: one misbehaviour per run, for `tests/all/adversarial.rs`.
//!
//! Each case prints `NAME: RESULT` lines (`RESULT` is `ok`, `KIND (message)` for a host error,
//! or a case-specific value). Cases that end in a trap print what they hold first, so the host
//! test can check the tenant's charges were returned however the run ended.

use std::io::Write as _;

use tpubox_guest::bindings::tpubox::device::{client, types};
use tpubox_guest::{Dtype, Tensor};

use crate::{ADD, SCALAR_ADD, raw_tensor, report};

const FMT: client::ProgramFormat = client::ProgramFormat::MlirText;
const OPTS: client::CompileOptions = client::CompileOptions { device: None };

/// Largest number of handles a bomb creates before giving up (the host must refuse earlier).
const BOMB_CAP: usize = 100_000;

fn small() -> types::Tensor {
    raw_tensor(Dtype::F32, &[2, 2], 16, None).expect("a 2x2 tensor")
}

fn add() -> types::Executable {
    client::compile(FMT, ADD.as_bytes(), OPTS).expect("ADD compiles")
}

fn flush() {
    let _ = std::io::stdout().flush();
}

/// `made` handles from `make` until the host refuses; prints the refusal and the count, then
/// frees everything and shows one more can be made.
fn bomb<T>(name: &str, mut make: impl FnMut() -> Result<T, types::Error>) {
    let mut held = Vec::new();
    let err = loop {
        if held.len() >= BOMB_CAP {
            println!("{name}: never refused");
            return;
        }
        match make() {
            Ok(t) => held.push(t),
            Err(e) => break e,
        }
    };
    report(name, Err::<(), _>(err));
    println!("{name}-made: {}", held.len());
    drop(held);
    report(&format!("{name}-after-free"), make());
}

/// Gives the guest a handle it was never given: the generated bindings take any number.
fn forge_tensor(handle: u32) -> types::Tensor {
    // SAFETY: none; forging a handle is the point of this test. The host must reject it.
    unsafe { types::Tensor::from_handle(handle) }
}

fn hold_some() -> (types::Executable, Vec<types::Tensor>) {
    let exe = add();
    let held: Vec<types::Tensor> = (0..4).map(|_| small()).collect();
    println!("holding: 1 executable, {} tensors", held.len());
    flush();
    (exe, held)
}

fn spin() -> ! {
    let mut x: u64 = 0;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

/// Recurses until the stack runs out (`n` never reaches `u64::MAX`).
fn recurse(n: u64) -> u64 {
    let pad = std::hint::black_box([n; 64]);
    if pad[n as usize % 64] == u64::MAX {
        return 0;
    }
    recurse(pad[n as usize % 64] + 1) + pad[0]
}

/// `ADD` padded with a comment to exactly `len` bytes.
fn padded_program(len: usize) -> Vec<u8> {
    let mut code = ADD.as_bytes().to_vec();
    code.extend_from_slice(b"// ");
    code.resize(len.max(code.len()), b'x');
    code
}

fn broadcast_program(n: u64) -> String {
    format!(
        r#"
func.func public @main(%a: tensor<f32>) -> tensor<{n}xf32> {{
  %0 = stablehlo.broadcast_in_dim %a, dims = [] : (tensor<f32>) -> tensor<{n}xf32>
  return %0 : tensor<{n}xf32>
}}
"#
    )
}

pub fn run(name: &str, arg: Option<&str>) {
    let num = || -> u64 {
        arg.and_then(|a| a.parse().ok())
            .expect("a numeric argument")
    };
    match name {
        // ---- per-tenant limits ----
        "tensor-bomb" => bomb(name, || raw_tensor(Dtype::F32, &[2, 2], 16, None)),
        "bytes-bomb" => bomb(name, || raw_tensor(Dtype::U8, &[65536], 65536, None)),
        "executable-bomb" => bomb(name, || client::compile(FMT, ADD.as_bytes(), OPTS)),
        "compile-rate" => {
            let first = add();
            // Distinct programs (a comment makes each its own cache key): a compile the host's
            // tier 1 serves is not charged against max-compiles-per-minute, so compiling ADD
            // again would never be refused.
            let mut n = 0u64;
            let err = loop {
                n += 1;
                let program = format!("{ADD}\n// compile-rate {n}\n");
                if let Err(e) = client::compile(FMT, program.as_bytes(), OPTS) {
                    break e;
                }
            };
            report(name, Err::<(), _>(err));
            let out = client::execute(&first, &[&small(), &small()], &[]);
            report("compile-rate-execute-still-works", out);
        }
        "big-program" => {
            let limit = num() as usize;
            report(name, client::compile(FMT, &padded_program(limit + 1), OPTS));
            report(
                "big-program-at-limit",
                client::compile(FMT, &padded_program(limit), OPTS),
            );
        }
        "output-bomb" => {
            // 64 MiB of output from a 4-byte input: refused before the device allocates it
            // (at compile, since the tenant's byte limit could never hold the result).
            let x = Tensor::scalar(1.0f32).unwrap();
            match client::compile(FMT, broadcast_program(16 << 20).as_bytes(), OPTS) {
                Ok(exe) => report(name, client::execute(&exe, &[x.as_raw()], &[])),
                Err(e) => report(name, Err::<(), _>(e)),
            }
            let small_exe = client::compile(FMT, broadcast_program(4).as_bytes(), OPTS)
                .expect("small broadcast compiles");
            report(
                "output-bomb-small",
                client::execute(&small_exe, &[x.as_raw()], &[]),
            );
        }
        "read-bomb" => {
            // A device tensor larger than the guest's memory cap, read back into the guest.
            let exe = client::compile(FMT, broadcast_program(num()).as_bytes(), OPTS)
                .expect("broadcast compiles");
            let x = Tensor::scalar(1.0f32).unwrap();
            let out = client::execute(&exe, &[x.as_raw()], &[]).expect("broadcast runs");
            println!("read-bomb-made: {}", out[0].byte_size());
            flush();
            report(name, out[0].read().map(|b| b.len()));
        }
        "memory-bomb" => {
            let mut chunks: Vec<Vec<u8>> = Vec::new();
            loop {
                let mut v = Vec::new();
                if v.try_reserve_exact(1 << 20).is_err() {
                    break;
                }
                v.resize(1 << 20, 1u8);
                chunks.push(v);
                if chunks.len() > 1 << 14 {
                    break;
                }
            }
            println!("memory-bomb: refused after {} MiB", chunks.len());
            drop(chunks);
            let again = vec![2u8; 1 << 20];
            println!("memory-bomb-after-free: ok {}", again.len());
        }
        "memory-abort" => {
            let _ = hold_some();
            let v = vec![1u8; 1 << 30];
            println!("memory-abort: allocated {}", v.len());
        }
        // ---- ending badly while holding resources ----
        "infinite-loop" => {
            let _held = hold_some();
            spin();
        }
        "fuel-burn" => spin(),
        // ---- a program from stdin (hostile programs of tests/all/adversarial.rs) ----
        "run-stdin" => run_stdin(),
        "panic" => {
            let _held = hold_some();
            panic!("the guest panics on purpose while holding device resources");
        }
        "exit" => {
            let _held = hold_some();
            std::process::exit(3);
        }
        "stack-overflow" => {
            let _held = hold_some();
            println!("stack-overflow: {}", recurse(0));
        }
        "sleep" => {
            // Blocks in a host call, where no wasm runs to notice the deadline.
            let _held = hold_some();
            std::thread::sleep(std::time::Duration::from_secs(num()));
            println!("sleep: woke");
        }
        // ---- handles ----
        "forge-handle" => report(name, forge_tensor(12345).read()),
        "forge-dropped" => {
            let t = small();
            let h = t.handle();
            drop(t);
            report(name, forge_tensor(h).read());
        }
        "forge-type" => {
            let exe = add();
            report(name, forge_tensor(exe.handle()).read());
        }
        "read-after-donate"
        | "execute-after-donate"
        | "copy-after-donate"
        | "donate-after-donate" => {
            let exe = add();
            let (a, b) = (small(), small());
            client::execute(&exe, &[&a, &b], &[0]).expect("donating call");
            match name {
                "read-after-donate" => report(name, a.read()),
                "execute-after-donate" => report(name, client::execute(&exe, &[&a, &b], &[])),
                "copy-after-donate" => report(name, a.copy_to_device(0)),
                _ => report(name, client::execute(&exe, &[&a, &b], &[0])),
            }
            report("other-still-usable", b.read());
        }
        "copy-bad-device" => report(name, small().copy_to_device(7)),
        "donate-weight" => {
            let set = tpubox_guest::weights::WeightSet::open("test").expect("test weights");
            let w = set.get("w").expect("w");
            let exe = add();
            report(name, client::execute(&exe, &[w.as_raw(), &small()], &[0]));
            println!(
                "weight-still-readable: {:?}",
                set.get("w").unwrap().to_vec::<f32>().unwrap()
            );
        }
        "missing-weights" => report(
            name,
            tpubox_guest::weights::WeightSet::open("secret-of-another-tenant")
                .map_err(types::Error::from),
        ),
        "missing-weight-tensor" => {
            let set = tpubox_guest::weights::WeightSet::open("test").expect("test weights");
            report(name, set.get("../w").map_err(types::Error::from));
        }
        "no-main" => report(
            name,
            client::compile(FMT, SCALAR_ADD.replace("@main", "@other").as_bytes(), OPTS),
        ),
        // ---- the sandbox ----
        "network-connect" => {
            let r = std::net::TcpStream::connect("127.0.0.1:80");
            println!("{name}: {}", io_result(r));
        }
        "network-listen" => {
            let r = std::net::TcpListener::bind("127.0.0.1:0");
            println!("{name}: {}", io_result(r));
        }
        "network-udp" => {
            let r = std::net::UdpSocket::bind("0.0.0.0:0")
                .and_then(|s| s.send_to(b"x", "127.0.0.1:53"));
            println!("{name}: {}", io_result(r));
        }
        "network-dns" => {
            use std::net::ToSocketAddrs;
            let r = ("localhost", 80).to_socket_addrs();
            println!("{name}: {}", io_result(r));
        }
        "env" => {
            let names: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
            println!("{name}: {} {}", names.len(), names.join(","));
        }
        "fs-read" => {
            let path = arg.unwrap_or("/etc/passwd");
            println!("{name}: {}", io_result(std::fs::read(path)));
        }
        "fs-list" => {
            let path = arg.unwrap_or("/");
            println!("{name}: {}", io_result(std::fs::read_dir(path)));
        }
        "fs-write" => {
            let path = arg.unwrap_or("/tmp/tpubox-probe-was-here");
            println!("{name}: {}", io_result(std::fs::write(path, b"pwned")));
        }
        "clock" => {
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let start = std::time::Instant::now();
            // Work the host can see pass: a few device round trips.
            for _ in 0..20 {
                let _ = small().read();
            }
            let mono = start.elapsed().as_nanos();
            println!("{name}: wall {wall} mono {mono}");
        }
        _ => {
            eprintln!("probe: no abuse case named {name:?}");
            std::process::exit(2);
        }
    }
}

fn io_result<T>(r: std::io::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("err {:?}", e.kind()),
    }
}

/// Compiles the MLIR text on stdin, prints `compile: RESULT`, then runs it on zero-filled
/// arguments of its parameters' specs and prints `execute: RESULT`.
fn run_stdin() {
    let mut code = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut code).expect("stdin");
    let exe = match client::compile(FMT, &code, OPTS) {
        Ok(exe) => exe,
        Err(e) => return report("compile", Err::<(), _>(e)),
    };
    println!("compile: ok");
    flush();
    let mut args = Vec::new();
    for spec in exe.inputs() {
        let n = spec.dims.iter().product::<u64>() as usize * spec.dtype.size_bytes();
        match raw_tensor(spec.dtype, &spec.dims, n, None) {
            Ok(t) => args.push(t),
            Err(e) => return report("execute", Err::<(), _>(e)),
        }
    }
    let borrowed: Vec<&types::Tensor> = args.iter().collect();
    report("execute", client::execute(&exe, &borrowed, &[]));
}
